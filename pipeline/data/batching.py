"""Length-bucketed batches with dynamic padding.

Padding every review to the longest one in the split (512 tokens) wastes most of the compute on IMDB,
whose median review is far shorter. Batches here are drawn from pools of similar-length reviews and
padded only to the longest member (rounded up to a multiple of 8), and the order of batches is
shuffled so the model does not see a length curriculum."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

#: The label of a review whose gold label is not known (the distill stage's transfer reviews).
NO_LABEL = -1


class TokenizedDataset(Dataset):
    """Unpadded token-id arrays plus labels (`NO_LABEL` where unknown) and, for distillation, the teacher's
    logits per review (`soft_targets`)."""

    def __init__(self, input_ids: Sequence[np.ndarray], labels: Sequence[int],
                 soft_targets: np.ndarray | None = None) -> None:
        if len(input_ids) != len(labels):
            raise ValueError(f"{len(input_ids)} reviews but {len(labels)} labels")
        if soft_targets is not None and len(soft_targets) != len(labels):
            raise ValueError(f"{len(input_ids)} reviews but {len(soft_targets)} soft targets")
        self.input_ids = list(input_ids)
        self.labels = np.asarray(labels, dtype=np.int64)
        self.soft_targets = None if soft_targets is None else np.asarray(soft_targets, dtype=np.float32)
        self.lengths = np.asarray([len(x) for x in self.input_ids], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, i: int) -> tuple[Any, ...]:
        if self.soft_targets is None:
            return self.input_ids[i], int(self.labels[i])
        return self.input_ids[i], int(self.labels[i]), self.soft_targets[i]


class Collator:
    """Pad a list of (ids, label) or (ids, label, teacher logits) to the longest in the batch, rounded up to
    `multiple_of`; teacher logits come out as `teacher_logits`."""

    def __init__(self, pad_id: int = 0, multiple_of: int = 8, max_length: int | None = None) -> None:
        self.pad_id = pad_id
        self.multiple_of = multiple_of
        self.max_length = max_length

    def __call__(self, batch: Sequence[tuple[Any, ...]]) -> dict[str, torch.Tensor]:
        longest = max(len(item[0]) for item in batch)
        width = math.ceil(longest / self.multiple_of) * self.multiple_of
        if self.max_length is not None:
            width = max(min(width, self.max_length), longest)
        input_ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, item in enumerate(batch):
            ids = item[0]
            input_ids[row, : len(ids)] = torch.from_numpy(np.asarray(ids, dtype=np.int64))
            mask[row, : len(ids)] = 1
        out = {"input_ids": input_ids, "attention_mask": mask,
               "labels": torch.tensor([item[1] for item in batch], dtype=torch.long)}
        if len(batch[0]) > 2:
            out["teacher_logits"] = torch.from_numpy(np.stack([item[2] for item in batch]))
        return out


class LoaderPosition:
    """Where a resumed run re-enters an epoch: the batches of `epoch` already trained, skipped once by the batch
    sampler that holds this object (set by `pipeline.training.resume` from the checkpoint)."""

    def __init__(self) -> None:
        self.epoch: int | None = None
        self.batches_done = 0

    def resume_at(self, epoch: int, batches_done: int) -> None:
        self.epoch, self.batches_done = epoch, batches_done

    def take(self, epoch: int) -> int:
        """The batches to skip in `epoch` (once: the next epoch starts from its first batch)."""
        if self.epoch != epoch:
            return 0
        done, self.epoch, self.batches_done = self.batches_done, None, 0
        return done


class EpochCounter:
    """The epoch a batch sampler is in. Lightning advances samplers by calling `set_epoch` on a loader's `sampler` and
    on its `batch_sampler.sampler`, never on the batch sampler itself: a batch sampler that holds no index sampler
    keeps this as its `sampler`, or every epoch would repeat the first one's order (and a resumed epoch would skip
    by the wrong epoch's position)."""

    def __init__(self) -> None:
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


class LengthBucketBatchSampler(Sampler[list[int]]):
    """Batches of similar length, in shuffled order, optionally sharded across DDP ranks.

    Indices are shuffled, cut into pools of `pool_batches * batch_size`, each pool is sorted by length
    and cut into batches, then all batches are shuffled. With `num_replicas > 1` every rank takes an
    equal, disjoint share of the batches (the tail that does not divide evenly is dropped on all ranks
    so collective ops stay in step).

    An epoch's order depends only on (seed, epoch), so a resumed run rebuilds it and, through `position`, skips the
    batches the interrupted run had already trained; `len()` stays the whole epoch's, as Lightning's loop expects.
    The epoch is read when the first batch is drawn, not when the iterator is made: Lightning makes a resumed run's
    first iterator before it sets that epoch.
    """

    def __init__(self, lengths: Sequence[int], batch_size: int, pool_batches: int = 50, shuffle: bool = True,
                 seed: int = 0, num_replicas: int = 1, rank: int = 0, drop_last: bool = False,
                 position: LoaderPosition | None = None) -> None:
        if batch_size < 1 or pool_batches < 1:
            raise ValueError("batch_size and pool_batches must be >= 1")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} not in [0, {num_replicas})")
        self.lengths = np.asarray(lengths)
        self.batch_size = batch_size
        self.pool = pool_batches * batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.num_replicas = num_replicas
        self.rank = rank
        self.drop_last = drop_last
        self.position = position
        self.sampler = EpochCounter()

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        """Every epoch gets a new (but reproducible) order; Lightning sets it through `sampler` (`EpochCounter`)."""
        self.sampler.set_epoch(epoch)

    def _all_batches(self) -> list[list[int]]:
        rng = np.random.default_rng(self.seed + self.epoch)
        order = rng.permutation(len(self.lengths)) if self.shuffle else np.arange(len(self.lengths))
        batches: list[list[int]] = []
        for start in range(0, len(order), self.pool):
            pool = order[start : start + self.pool]
            pool = pool[np.argsort(self.lengths[pool], kind="stable")]
            for b in range(0, len(pool), self.batch_size):
                batch = pool[b : b + self.batch_size].tolist()
                if len(batch) == self.batch_size or not self.drop_last:
                    batches.append(batch)
        if self.shuffle:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        if self.num_replicas > 1:
            usable = len(batches) - len(batches) % self.num_replicas
            batches = batches[self.rank : usable : self.num_replicas]
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        skip = self.position.take(self.epoch) if self.position is not None else 0
        yield from self._all_batches()[skip:]

    def __len__(self) -> int:
        return len(self._all_batches())
