"""The teacher labels the student's training reviews: the labelled training split (gold labels kept) and the
unlabelled transfer split (`NO_LABEL`), each with the teacher's logits, on the device and in the precision the
student trains in."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pipeline.core.params import TEACHER_READS, TrainParams
from pipeline.data.batching import NO_LABEL, TokenizedDataset
from pipeline.data.imdb import TRANSFER
from pipeline.surgery.errors import DistillError


@dataclass(frozen=True)
class TransferSet:
    """Training reviews for the student: token ids, gold labels (`NO_LABEL` for transfer reviews) and the
    teacher's logits for every one of them."""

    input_ids: list[np.ndarray]
    labels: np.ndarray
    teacher_logits: np.ndarray
    labelled: int
    unlabelled: int

    def dataset(self) -> TokenizedDataset:
        """The student's training split: every review with its label and the teacher's logits."""
        return TokenizedDataset(self.input_ids, self.labels, self.teacher_logits)


def read_transfer_ids(tokenized_dir: Path) -> list[np.ndarray]:
    """Token ids of the unlabelled transfer split (none when prepare wrote none); its label column is never read,
    and a split that has one is refused."""
    from pipeline.data.tokens import read_tokenized

    if not (tokenized_dir / f"{TRANSFER}.parquet").is_file():
        return []
    frame = read_tokenized(tokenized_dir, TRANSFER)
    if "label" in frame.columns:
        raise DistillError(f"{tokenized_dir / TRANSFER}.parquet has a label column; the transfer split must be "
                           "unlabelled (re-run `dvc repro prepare`)")
    return frame["input_ids"].tolist()


@dataclass(frozen=True)
class Labelling:
    """Where and how the teacher labels the reviews."""

    device: str  # the device the student trains on: "cuda" where training uses the GPU, else "cpu"
    autocast: str | None  # `TorchRunner` autocast: what the resolved training precision runs in, None for fp32


def labelling_setup(train: TrainParams, precision: str, cuda: bool | None = None) -> Labelling:
    """The teacher labels on the device the student trains on, in the training precision `precision` (resolved,
    not `auto`): bf16 autocast for bf16-mixed (resolved so only where bf16 is native), fp16 autocast for 16-mixed
    on CUDA, fp32 otherwise."""
    from pipeline.core.machine import trains_on_cuda

    on_gpu = trains_on_cuda(train.accelerator, cuda)
    autocast = "bf16" if precision.startswith("bf16") else "fp16" if precision.startswith("16") and on_gpu else None
    return Labelling("cuda" if on_gpu else "cpu", autocast)


def teacher_logits(teacher: torch.nn.Module, seqs: list[np.ndarray], batch_size: int, pad_id: int,
                   labelling: Labelling) -> np.ndarray:
    """The teacher's logits per review (its predictions are the student's targets), computed on
    `labelling.device`; the teacher is back on the CPU afterwards, where the student is built from it."""
    from pipeline.runtimes.eager import predict_logits_on

    return predict_logits_on(teacher.eval(), labelling.device, seqs, batch_size, pad_id, labelling.autocast,
                             progress="teacher labels")


def transfer_set(teacher: torch.nn.Module, labelled: TokenizedDataset, transfer_ids: list[np.ndarray], *,
                 window: Callable[[np.ndarray], np.ndarray] | None, teacher_reads: str, batch_size: int, pad_id: int,
                 labelling: Labelling) -> TransferSet:
    """The labelled training reviews and the transfer reviews (`NO_LABEL`), each in the student's training window,
    with the teacher's logits. `labelled` holds whole prepared reviews; the teacher reads each in the training
    window (`teacher_reads: window`) or whole (`review`: its prediction from more of the text is the target for
    what the student sees)."""
    if teacher_reads not in TEACHER_READS:
        raise DistillError(f"distill.teacher_reads must be one of {TEACHER_READS}, not {teacher_reads!r}")
    reviews = [*labelled.input_ids, *transfer_ids]
    seqs = [window(ids) for ids in reviews] if window is not None else reviews
    labels = np.concatenate([labelled.labels, np.full(len(transfer_ids), NO_LABEL, dtype=np.int64)])
    logits = teacher_logits(teacher, reviews if teacher_reads == "review" else seqs, batch_size, pad_id, labelling)
    return TransferSet(seqs, labels, logits, len(labelled.labels), len(transfer_ids))
