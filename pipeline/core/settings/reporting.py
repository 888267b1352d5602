"""Settings sections for tracking, scoring, timing and serving: `mlflow`, `evaluate`, `benchmark`, `targets`,
`package`."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from pipeline.core.settings.choices import Auto, Prefer
from pipeline.core.settings.validation import settings_section

Threads = Annotated[int, Field(ge=1)] | None


@settings_section("mlflow")
class MlflowParams:
    """Where runs are tracked and under which names.

    `tracking_uri` is the default store; the environment variable `MLFLOW_TRACKING_URI` (e.g. a remote
    `http://host:5000` tracking server) wins over it, so the same params run against a shared server unchanged."""

    tracking_uri: str = "sqlite:///mlflow.db"
    """overridden by $MLFLOW_TRACKING_URI when that is set"""
    experiment: str = Field("sentiment-pipeline", min_length=1)
    registered_model_name: str = Field("imdb-sentiment", min_length=1)
    """the package stage registers the served variant under it"""
    champion_alias: str = Field("champion", min_length=1)
    """the alias the package stage moves to the version it packaged"""
    system_metrics: bool = True
    """the finetune run samples CPU, memory (and GPU) load as `system/*` metrics"""


@settings_section("evaluate")
class EvaluateParams:
    """How every variant is scored on the test split."""

    batch_size: int = Field(16, ge=1)
    """Equal to train.eval_batch_size, finetune's FP32 test logits are reused (else FP32 is scored again)."""
    threads: Threads = None
    """intra-op threads (null = the OMP_NUM_THREADS cap where set, else the runtime's default)"""
    artifact_max_mb: float = Field(200.0, ge=0)
    """larger variant files are logged to MLflow as a path, not a copy"""


@settings_section("benchmark")
class BenchmarkParams:
    """How variants are timed: batch-1 latency at a fixed length, batch throughput, memory."""

    seq_len: int = Field(128, ge=8)
    """batch-1 latency on real reviews truncated/padded to this length"""
    batch_size: int = Field(32, ge=1)
    """throughput batch, dynamic padding"""
    warmup: int = Field(5, ge=0)
    """untimed calls per variant at the start and again before each round"""
    settle_s: float = Field(0.05, ge=0)
    """seconds idle before each variant's round: the previous variant's runtime threads spin for a while after its
    last call, and on a 2-core machine they take a core from the next variant's first calls (docs/benchmarks.md)"""
    iterations: int = Field(100, ge=1)
    """latency samples per variant, spread over the rounds (at least one per round)"""
    rounds: int = Field(5, ge=1)
    """A B C ... A B C: drift hits every variant alike"""
    apart_after: int | None = Field(3, ge=1)
    """rounds after which a row the package stage never serves (the FP32 exports, the timing rows) is not timed
    again once clearly slower than every servable INT8 variant (its fastest round's p50 above their slowest);
    FP32 eager, the reference, runs every round; null: every row runs every round"""
    latency_reviews: int = Field(100, ge=1)
    throughput_batches: int = Field(1, ge=1)
    """batches per round, median over the rounds"""
    threads: Threads = None
    """null = the OMP_NUM_THREADS cap where set, else every CPU this process may run on (its affinity mask, which
    taskset and container cpusets narrow); recorded in the report"""
    bf16_row: bool | Auto = "auto"
    """FP32 weights under bf16 autocast; auto: only on a CPU with native bf16 (emulated bf16 is far slower)"""
    memory: bool = True
    """peak RSS of a fresh process per variant"""

    @model_validator(mode="after")
    def _every_round_samples(self) -> BenchmarkParams:
        if self.iterations < self.rounds:
            raise ValueError(f"iterations: must be at least rounds ({self.rounds}), got {self.iterations}")
        return self


@settings_section("targets")
class TargetsParams:
    """The goals every report judges against: evaluate's and the benchmark's target lines, and package's choice."""

    max_accuracy_loss_pt: float = Field(0.5, ge=0)
    """an INT8 variant counts only within this many points of FP32 test accuracy"""
    min_speedup: float = Field(3.0, gt=0)
    """batch-1 p50 speed-up over FP32 eager an INT8 variant should reach"""
    max_size_share: float = Field(0.30, gt=0, le=1)
    """an INT8 variant's file should be at most this share of fp32-onnx's"""
    qat_max_loss_pt: float = Field(0.2, ge=0)
    """A QAT variant should stay within this many points of FP32 and run at least as fast as the post-training
    variant of its runtime, at batch 1 and 32 (`pipeline.selection.QAT_PAIRS`; issue 43)"""


@settings_section("package")
class PackageParams:
    """Which variant goes into the TorchServe archive and the endpoint's limits."""

    variant: str = Field("auto", min_length=1)
    """auto = an INT8 variant within targets.max_accuracy_loss_pt of FP32, else fp32-onnx; otherwise a variant name
    of `pipeline.runtimes.catalog` (checked by the package stage)"""
    prefer: Prefer = "accuracy"
    """Which one `auto` serves: the most accurate within the window, or the fastest at batch 1 (benchmark p50)"""
    max_texts: int = Field(64, ge=1)
    """most texts in one {"texts": [...]} request"""
    max_body_bytes: int = Field(1_000_000, ge=1024)
    """larger bodies get a JSON 413 (config.properties' max_request_size is above it)"""
    max_chars_per_text: int = Field(20_000, ge=64)
    """a longer text is refused (413) by both servers; above every IMDB review, so every served review tokenizes
    exactly as in training"""
    max_json_depth: int = Field(8, ge=4)
    """deepest nesting of JSON arrays/objects in a body; deeper: 400. Valid requests need 2 (TorchServe's
    {"texts": [...]}) to 4 (MLflow's {"dataframe_split": {"data": [[...]]}}), so less than 4 is refused"""
    threads: Threads = None
    """intra-op threads per worker (null = the OMP_NUM_THREADS cap where set, else the runtime's default)"""
