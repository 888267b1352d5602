"""What makes a training checkpoint belong to a run (`Fingerprint`): the job's settings, a digest of its input files
and a digest of the training code; a checkpoint is resumed only when all three match."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.core.io import digest_paths
from pipeline.core.params import TrainParams, flatten, to_dict

#: The code whose change makes an old checkpoint another trajectory (relative to the `pipeline` package).
TRAINING_CODE = ("training", "surgery", "runtimes", "data", "modeling.py")
#: `train` keys that change where or how fast a job runs, not what it computes: not part of the fingerprint.
RESUME_NEUTRAL = frozenset({
    "checkpoint_every_n_steps", "checkpoint_dir", "resume", "launcher", "min_nodes", "max_restarts",
    "rdzv_endpoint", "rdzv_id", "num_workers", "pin_memory", "persistent_workers", "profiler", "threads",
})


@dataclass(frozen=True)
class Fingerprint:
    """What makes a checkpoint belong to this run: the job's settings, its input files and the training code."""

    settings: dict[str, Any]
    data: str
    code: str

    def differences(self, saved: Fingerprint) -> list[str]:
        """What changed since `saved`, one short phrase each (settings as `section.key old -> new`)."""
        out = []
        old, new = flatten(saved.settings), flatten(self.settings)
        for key in sorted(old.keys() | new.keys()):
            if old.get(key, "<unset>") != new.get(key, "<unset>"):
                out.append(f"{key} {old.get(key, '<unset>')!r} -> {new.get(key, '<unset>')!r}")
        if saved.data != self.data:
            out.append("input data changed")
        if saved.code != self.code:
            out.append("training code changed (" + ", ".join(f"pipeline/{c}" for c in TRAINING_CODE)
                       + " or the job's own modules)")
        return out


def training_code_digest(code: Sequence[Path] = ()) -> str:
    """Digest of the training code (`TRAINING_CODE`) and of a job's own modules outside it (`code`) as they are on
    disk."""
    package = Path(__file__).resolve().parents[1]
    return digest_paths([package / rel for rel in TRAINING_CODE] + list(code))


def fingerprint(settings: Mapping[str, Any], inputs: Sequence[Path], code: Sequence[Path] = ()) -> Fingerprint:
    """The fingerprint of a job with these settings (JSON-able sections) reading these input files/dirs, its code
    the training code and `code` (the modules that build what a QAT job trains, under `pipeline/variants`)."""
    plain = json.loads(json.dumps(settings, default=str))  # tuples, paths ... as a re-read file would have them
    return Fingerprint(plain, digest_paths(inputs), training_code_digest(code))


def trajectory_settings(train: Mapping[str, Any]) -> dict[str, Any]:
    """A `train` section without the keys that do not change the trained weights (`RESUME_NEUTRAL`)."""
    return {k: v for k, v in train.items() if k not in RESUME_NEUTRAL}


def training_trajectory(train: TrainParams) -> dict[str, Any]:
    """What of a job's resolved `train` settings shapes its weights (`trajectory_settings`), with the attention
    kernel `fit` derives from them (`training_attention`): named, so that a checkpoint trained with another
    kernel (by code before a change of that rule, which lives outside `TRAINING_CODE`) starts afresh rather than
    changing kernels mid-run. finetune's and distill's fingerprints take their train part here; QAT, whose
    trainer settings are fixed, names the kernel beside its own settings (`pipeline.training.qat`)."""
    from pipeline.core.machine import training_attention

    return {**trajectory_settings(to_dict(train)),
            "attention": training_attention(train.precision, train.accelerator).value}
