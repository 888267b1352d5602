"""A variant's self-describing directory: the model file, `variant.json` (name, format, dtype, file, params,
status and reason, and the CPU and ISA flags it was built on), the tokenizer, and the finetune stage's
`pipeline.json` (label map, preprocessing).

A variant directory is built whole or not at all (`building`): its files are written into a hidden sibling
directory that replaces the final one only once the record is written, so a process killed mid-build never leaves
a record beside a model file it does not describe."""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pipeline.core import io
from pipeline.core.errors import UserError
from pipeline.core.io import write_json
from pipeline.runtimes.batch_invariance import batching_record
from pipeline.runtimes.catalog import spec

VARIANT_FILE = "variant.json"


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


class VariantError(UserError):
    """A variant directory is missing, incomplete or cannot be run."""


@dataclass
class VariantInfo:
    """What `variant.json` says about a variant."""

    name: str
    format: str  # the registry's format: eager | torchscript | onnx | openvino | tensorrt
    dtype: str  # the registry's precision: float32 | bfloat16 | float16 | int8
    file: str | None
    status: str = "ok"  # ok | skipped
    reason: str = ""
    params: dict[str, Any] = field(default_factory=dict)
    built_on: dict[str, Any] = field(default_factory=dict)  # CPU model and ISA flags (`core.machine.isa_record`)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def built(cls, name: str, params: dict[str, Any]) -> VariantInfo:
        """The record of a variant that was built: format, dtype and file come from the registry."""
        row = spec(name)
        return cls(name, row.format, row.precision, row.file, params=params)

    @classmethod
    def skipped(cls, name: str, reason: str, params: dict[str, Any]) -> VariantInfo:
        """The record of a variant that could not or should not be built here, with the reason."""
        row = spec(name)
        return cls(name, row.format, row.precision, None, "skipped", reason, params)


def write_variant(directory: Path, info: VariantInfo, finetuned_dir: Path) -> None:
    """Write `variant.json` (with the CPU it was built on and, for a servable variant, how it is batched:
    `batch_invariance.batching_record` of its model file, written before) and copy the tokenizer and preprocessing
    record next to the model file, the record last.

    A builder calls it on the directory `building` gave it, which is published whole once this has run."""
    from pipeline.core.machine import isa_record

    if not info.built_on:
        info.built_on = isa_record()
    if info.status == "ok" and info.file and info.format in ("onnx", "torchscript", "openvino"):
        info.params = {**info.params, **batching_record(info.format, directory / info.file)}
    directory.mkdir(parents=True, exist_ok=True)
    for name in (*TOKENIZER_FILES, "pipeline.json", "config.json"):
        src = finetuned_dir / name
        if src.is_file():
            shutil.copy2(src, directory / name)
    write_json(directory / VARIANT_FILE, info.to_dict())


@contextlib.contextmanager
def building(final_dir: Path) -> Iterator[Path]:
    """A fresh directory to build the variant `final_dir` in, which replaces `final_dir` whole when the block ends
    without error and has written `variant.json` (`write_variant`, which writes it last); removed, with
    `final_dir` left as it was, when the block raises or wrote no record (a directory without one is not a
    variant). How the swap works and why it is safe: `pipeline.core.io.directory_replaced_on_success`; nothing
    lists its hidden siblings as variants (`catalog.directories` goes by the registry's names)."""
    try:
        with io.directory_replaced_on_success(Path(final_dir), complete_when=VARIANT_FILE) as work:
            yield work
    except io.IncompleteDirectory as exc:
        raise VariantError(f"the build of {final_dir} wrote no {VARIANT_FILE}: the previous directory is kept") \
            from exc


def write_skipped(final_dir: Path, info: VariantInfo, model_dir: Path) -> None:
    """Replace `final_dir` with the record of a variant that was not built (`VariantInfo.skipped`, with its
    reason) and the tokenizer of `model_dir`, through `building`: no model file of an earlier build stays beside
    the record that says there is none."""
    with building(final_dir) as work:
        write_variant(work, info, model_dir)


def read_variant(directory: Path) -> VariantInfo:
    """The variant record, with a clear error naming the file when it is missing or corrupt."""
    path = Path(directory) / VARIANT_FILE
    if not path.is_file():
        raise VariantError(f"not a variant directory (no {VARIANT_FILE}): {directory}")
    try:
        return VariantInfo(**json.loads(path.read_text()))
    except (json.JSONDecodeError, TypeError) as exc:
        raise VariantError(f"corrupt {path}: {exc}") from exc


def model_file(directory: Path, info: VariantInfo) -> Path:
    """Path of the variant's model file, checked to exist."""
    if info.file is None:
        raise VariantError(f"variant {info.name} has no model file ({info.status}: {info.reason})")
    path = Path(directory) / info.file
    if not path.is_file():
        raise VariantError(f"model file of variant {info.name} missing: {path}")
    return path


def size_mb(directory: Path, info: VariantInfo) -> float:
    """On-disk size of the model file(s) alone (ONNX external data included), in MB."""
    path = model_file(directory, info)
    total = path.stat().st_size
    for data in (path.with_name(path.name + ".data"), path.with_suffix(".bin")):  # ONNX external data, IR weights
        if data != path and data.is_file():
            total += data.stat().st_size
    return total / 1e6


def variant_batching(directory: Path, info: VariantInfo | None = None) -> dict[str, Any]:
    """How the variant in `directory` is served (`batching_record`): from its record (`info` where the caller has
    read it already), or from its model file for a record written before the record carried it."""
    info = info or read_variant(directory)
    if "served_batching" in info.params:
        return {k: info.params[k] for k in ("served_batching", "served_batching_reason")}
    return batching_record(info.format, model_file(directory, info))
