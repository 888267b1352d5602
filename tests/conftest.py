"""Fixtures shared by every tier: the shared IMDB copy, a tiny 2-layer BERT saved in HF format, every variant of it
(`built`; both built once per session, whichever pytest-xdist worker asks first), tokenized synthetic splits, and
`repo` (a real `dvc repro` of the miniature profile, used by the e2e and model tiers).

Tiers: `unit/<area>` mirrors `pipeline/<area>` (plus `benchmarks`), `data` checks the shared IMDB copy,
`model` the exported artifacts of the end-to-end model, `serving` TorchServe and the image, `e2e` the
whole `dvc repro`. Plain helpers live in `tests.factories`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipeline.core.machine import FLAGS_OVERRIDE_ENV
from tests.factories import (
    AVX2_ONLY_FLAGS,
    IMDB_DIR,
    ROOT,
    link_venv,
    migrated_tracking_store,
    qat_precision_here,
    shared_across_workers,
    weight_format_here,
    write_tokenized,
)

os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


#: Test modules that share a session fixture too slow to build twice, by pytest-xdist scheduling group: the
#: miniature pipeline run (`repo`) and the real servers (`server`, `champion`, `proxy`; test_tracking_server's own
#: tracking server is also called `server`). `make test` runs two workers; a group runs in one of them, so its
#: fixtures are built once, and every other module is a group of its own, so its module fixtures are built once.
#: (xdist's `xdist_group` mark cannot do this under pytest 9: xdist 3.8 renames `item._nodeid`, which pytest 9 no
#: longer reads.) `pytest_collection_modifyitems` refuses a module that uses one of these fixtures but is not listed.
MODULE_GROUPS = {
    "tests/e2e/test_avx2_choices.py": "repro",
    "tests/e2e/test_dvc_remote.py": "repro",
    "tests/e2e/test_repro.py": "repro",
    "tests/model/test_behaviour.py": "repro",
    "tests/e2e/test_tracking_server.py": "servers",
    "tests/serving/test_concurrency_matrix.py": "servers",
    "tests/serving/test_conformance.py": "servers",
    "tests/serving/test_mlflow_serving.py": "servers",
    "tests/serving/test_torchserve.py": "servers",
}
#: Scheduling groups and modules handed out first, longest first. xdist queues the rest by test count, and these
#: have few tests each (whole-process runs, real servers, Spark): queued last, one of them kept a worker busy alone
#: at the end while the other stood idle. Ordered by each scope's summed test seconds in a `make test` (the figures
#: are in docs/testing.md); a stale entry only costs scheduling, never a test.
LONG_FIRST = ("repro", "servers", "tests/unit/training/test_resume.py", "tests/unit/deployment/test_batch_scoring.py",
              "tests/unit/deployment/test_batch_invariance.py", "tests/unit/runtimes/test_readout.py")
CHECKOUT_BEFORE = pytest.StashKey[set[str]]()
#: What the test tools themselves keep in the working directory (pytest's and hypothesis's caches, git-ignored).
TOOL_CACHES = {".pytest_cache", ".hypothesis"}
CHECKOUT_LEFT = pytest.StashKey[list[str]]()
SHARED_FIXTURES = {"repo": "repro", "server": "servers", "champion": "servers", "proxy": "servers",
                   "matrix": "servers"}


def pytest_sessionstart(session):
    """What the checkout holds before the tests (top level), so that `pytest_sessionfinish` can tell what they left."""
    if not hasattr(session.config, "workerinput"):  # the controlling process, not an xdist worker
        session.config.stash[CHECKOUT_BEFORE] = set(os.listdir(ROOT))


def pytest_sessionfinish(session, exitstatus):
    """Tests write under their temporary directories, never into the checkout: a new top-level entry (an MLflow
    `mlruns/`, a `checkpoints/` of a default `train.checkpoint_dir`, a `lightning_logs/`) fails the session."""
    before = session.config.stash.get(CHECKOUT_BEFORE, None)
    if before is None:
        return
    left = sorted(set(os.listdir(ROOT)) - before - TOOL_CACHES)
    if left:
        session.config.stash[CHECKOUT_LEFT] = left
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    left = config.stash.get(CHECKOUT_LEFT, None)
    if left:
        terminalreporter.section("tests wrote into the checkout", red=True)
        terminalreporter.line(f"new in {ROOT}: {', '.join(left)} (a test used a default relative path)")


def pytest_configure(config):
    """Under pytest-xdist the workers share the machine: each (and every process it starts: stages, servers, probes)
    gets its share of the CPUs through `OMP_NUM_THREADS`, which torch reads and the pipeline hands to onnxruntime and
    OpenVINO (`pipeline.core.machine.default_threads`). Without it every worker's thread pools size themselves to the
    whole machine and spin-wait against each other. A value the caller set is kept. A worker ends without the
    interpreter's last garbage collection (`pipeline.core.process_exit`), which the session would wait for. The
    third-party warnings a stage hides (`pipeline.core.third_party_output.THIRD_PARTY_WARNINGS`) are hidden here too,
    after pyproject.toml's filters: the one list for both."""
    from pipeline.core.third_party_output import THIRD_PARTY_WARNINGS

    for spec in THIRD_PARTY_WARNINGS:
        config.addinivalue_line("filterwarnings", spec)
    if hasattr(config, "workerinput"):  # an xdist worker: the controller waits for its process to end
        from pipeline.core.process_exit import skip_final_collection

        skip_final_collection()
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers > 1:
        from pipeline.core.machine import available_cpus

        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, available_cpus() // workers)))


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: only called where xdist runs the tests
def pytest_xdist_make_scheduler(config, log):
    """Module scheduling (xdist's `loadscope`) with the modules of `MODULE_GROUPS` merged into their group, the
    scopes of `LONG_FIRST` handed out before the others."""
    from xdist.scheduler import LoadScopeScheduling

    class SharedFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return MODULE_GROUPS.get(module, module)

        def _assign_work_unit(self, node) -> None:
            first = next((scope for scope in LONG_FIRST if scope in self.workqueue), None)
            if first is not None:
                self.workqueue.move_to_end(first, last=False)
            super()._assign_work_unit(node)

    return SharedFixtureScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """A module that uses a shared slow fixture must be in its group (`MODULE_GROUPS`), or two workers would each
    build it. An entry of `LONG_FIRST` names a group or a test module that exists. Tests marked `gpu` need a CUDA
    device: skipped, with the reason, where none is visible."""
    unknown = [s for s in LONG_FIRST if s not in MODULE_GROUPS.values() and not (ROOT / s).is_file()]
    if unknown:
        raise pytest.UsageError(f"LONG_FIRST in tests/conftest.py names no group or test module: {unknown}")
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        for fixture in SHARED_FIXTURES.keys() & set(getattr(item, "fixturenames", ())):
            if MODULE_GROUPS.get(module) != SHARED_FIXTURES[fixture]:
                raise pytest.UsageError(f"{module} uses the session fixture {fixture!r}: add it to MODULE_GROUPS "
                                        f"in tests/conftest.py as {SHARED_FIXTURES[fixture]!r}")
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is visible")
    for item in gpu:
        item.add_marker(skip)


@pytest.fixture(autouse=True)
def no_outside_settings(monkeypatch, tmp_path):
    """Settings the caller's environment would impose are removed: a tracking server named there wins over params
    (`pipeline.core.parent_run`; the tests pick their own stores, the remote-server tests set their own), and
    `PIPELINE_CPU_FLAGS` would replace this CPU's flags in the `auto` decisions (the tests that rehearse another
    CPU set it themselves); the stage-time log (`PIPELINE_STAGE_LOG`) goes to the test's own directory."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("PIPELINE_CPU_FLAGS", raising=False)
    monkeypatch.setenv("PIPELINE_STAGE_LOG", str(tmp_path / "stages.jsonl"))  # stage times stay out of ./logs


@pytest.fixture(scope="session")
def imdb_dir() -> Path:
    """The offline IMDB copy; the tests need it (CI has it beside the checkout)."""
    if not (IMDB_DIR / "train.parquet").is_file():
        pytest.fail(f"shared IMDB data not found at {IMDB_DIR}; set IMDB_DIR")
    return IMDB_DIR


@pytest.fixture(scope="session")
def tokenizer():
    from pipeline.core.params import ModelParams
    from pipeline.modeling import load_tokenizer

    return load_tokenizer(ModelParams(source="tiny"))


def session_root(tmp_path_factory) -> Path:
    """The session's temporary root, shared by every pytest-xdist worker (each worker's own sits in it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def tracking_store(tmp_path_factory) -> Callable[[Path], str]:
    """`tracking_store(path)`: a new MLflow SQLite store at `path`, and its URI, for a test that logs to a store of its
    own. MLflow migrates a new database's schema on its first open (about 4 s of CPU, in each of some twenty tests);
    the migrated schema is built once for the session (`migrated_tracking_store`) and copied into place, where MLflow's
    first open finds it current and creates its Default experiment, as it does after migrating a new database."""
    template = shared_across_workers(session_root(tmp_path_factory), "tracking-store", migrated_tracking_store)

    def new(path: Path) -> str:
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(template / "mlflow.db", path)
        return f"sqlite:///{path}"

    return new


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer) -> Path:
    """A randomly initialised 2-layer BERT with our label map and the finetune stage's metadata (one for the whole
    session, however many workers run it: `shared_across_workers`; never write into it). Its biases and layer-norm
    scales are moved off their initial zeros and ones, as training moves them: otherwise a dozen of its tensors are
    equal, and int8-qat could not put its weights into fp32-onnx's graph by value (`onnx_weights.refill_weights`)
    as it does for a trained model, and would export its own."""
    import torch

    from pipeline.core.params import DataParams, ModelParams, TrainParams
    from pipeline.modeling import load_model
    from pipeline.training.loop import save_model

    def build(d: Path) -> None:
        model = load_model(ModelParams(source="tiny"), seed=0)
        noise = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, tensor in model.named_parameters():
                if name.endswith("bias") or "LayerNorm" in name:
                    tensor.add_(0.02 * torch.randn(tensor.shape, generator=noise))
        save_model(model, tokenizer, d, DataParams(max_length=64), ModelParams(source="tiny"), TrainParams())

    return shared_across_workers(session_root(tmp_path_factory), "tiny_model", build)


#: The variants `built` holds: every one the export, quantize and tensorrt stages build.
BUILT_VARIANTS = ["fp32-torchscript", "fp32-onnx", "int8-dynamic", "int8-static", "int8-qat", "int8-openvino",
                  "int8-qat-openvino", "tensorrt-fp16", "tensorrt-int8"]


@pytest.fixture(scope="session")
def built(tmp_path_factory, tiny_model_dir) -> dict[str, Any]:
    """All variants of the tiny model built by the stages' own code, plus tokenized synthetic data to score them on,
    and the stages' reports: built once for the whole session, however many workers run it
    (`shared_across_workers`). The unit tests of variants, evaluation and deployment read it, and the serving
    fixtures copy the variants they serve from it; none writes into it."""
    from pipeline.core.io import read_json, write_json
    from pipeline.core.params import ExportParams, Params, QuantizeParams, TensorRTParams, TrainParams
    from pipeline.runtimes.catalog import directories
    from pipeline.variants.export import run_export
    from pipeline.variants.quantize import run_quantize
    from pipeline.variants.tensorrt import run_tensorrt

    def build(root: Path) -> None:
        tok_dir = write_tokenized(root / "tokenized", {"train": 64, "val": 32, "test": 48})
        dirs = directories(root / "variants")
        export = run_export(finetuned=tiny_model_dir, tokenized=tok_dir, variants_root=root / "variants",
                            params=ExportParams(parity_samples=8, torchscript=True))
        q = QuantizeParams(calibration_samples=32, selection_samples=32, qat_train_samples=32, qat_batch_size=8,
                           qat_openvino_train_samples=32, calibration_methods=["minmax", "entropy"],
                           build=["int8-dynamic", "int8-static", "int8-qat", "int8-openvino", "int8-qat-openvino"])
        quantize = run_quantize(finetuned=tiny_model_dir, fp32_onnx=dirs["fp32-onnx"], tokenized=tok_dir,
                                variants_root=root / "variants", choice=weight_format_here(),
                                qat_precision=qat_precision_here(),
                                params=Params(quantize=q, train=TrainParams(checkpoint_dir=str(root / "ckpt"))))
        trt = run_tensorrt(finetuned=tiny_model_dir, fp32_onnx=dirs["fp32-onnx"], int8_static=dirs["int8-static"],
                           tokenized=tok_dir, variants_root=root / "variants",
                           params=Params(quantize=q, tensorrt=TensorRTParams(qdq_input=True)))
        write_json(root / "reports.json", {"export": export, "quantize": quantize, "trt": trt})

    root = shared_across_workers(session_root(tmp_path_factory), "variants", build)
    dirs = {n: d for n, d in directories(root / "variants").items() if n in BUILT_VARIANTS}
    return {"dirs": dirs, "root": root / "variants", "tokenized": root / "tokenized",
            **read_json(root / "reports.json")}


@pytest.fixture
def exported_as_built(built, monkeypatch) -> None:
    """`torch.onnx.export` of the tiny model answered by `built`'s fp32-onnx, which is that export (same model,
    opset and readout), for the tests of what `run_export` does with an export rather than of the exporter."""
    import pipeline.variants.export as export
    from pipeline.core.params import ExportParams

    def copy(model: Any, path: Path, max_length: int, opset: int) -> None:
        assert opset == ExportParams().opset, "built's fp32-onnx is exported at the default opset"
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built["dirs"]["fp32-onnx"] / "model.onnx", path)

    monkeypatch.setattr(export, "export_onnx", copy)


@pytest.fixture
def tokenized_dir(tmp_path) -> Path:
    """Tokenized train/val/test parquet files (synthetic reviews) in the prepare stage's layout."""
    return write_tokenized(tmp_path / "tokenized", {"train": 96, "val": 32, "test": 32})


#: The default profile in miniature, the one `dvc repro` of `make test` (fixture `repo`): `profiles/mini.yaml`, which
#: users run as `make run PROFILE=mini`. It builds what `make run` builds (every FP32 export and INT8 variant; no
#: student, no pruning, the TensorRT input only where a GPU would use it), on a few hundred reviews.
MINI_PROFILE = ROOT / "profiles" / "mini.yaml"
#: The opt-in parts on top of it (fixture `repo_opt_in`, `make test-all`): the student (explicitly, on whatever
#: precision this CPU trains in), the pruned variant and the TensorRT engine's QDQ input (built and scored here
#: although no engine can be). The teacher keeps all 6 of MiniLM's layers here, one epoch, so that a 3-layer student
#: and the pruned heads have something to take away.
OPT_IN = {"model.layers": None, "train.epochs": 1, "distill.enabled": True, "distill.depth": 3,
          "distill.epochs": 1, "prune.enabled": True, "prune.calibration_samples": 32, "tensorrt.qdq_input": True}


def _copy_repo(dst: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    for rel in files:
        src = ROOT / rel
        if src.is_file() and not rel.startswith(("data/", "models/", "metrics/", "plots/", "reports/")):
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)


def repro_copy(d: Path, profile: Path, extra: dict[str, Any] | None = None,
               extra_env: dict[str, str] | None = None) -> Path:
    """A fresh copy of the project in `d` with `profile` (checked as `make run PROFILE=...` checks it) and the dotted
    keys of `extra` merged over params.yaml as DVC's Hydra composition merges a profile, `data.local_dir` set to the
    shared IMDB copy (`make run IMDB_DIR=...`), after a real `dvc repro` (its output in `d/repro.log`); `extra_env`
    is added to the environment the stages run in. (`make run PROFILE=mini` runs `dvc exp run`, which costs about
    13 s more CPU than `dvc repro` for the same stages: the session's whole run stays on `dvc repro`.)"""
    from pipeline.core.params import read_profile, with_overrides

    _copy_repo(d)
    overrides = {**read_profile(profile), "data.local_dir": str(IMDB_DIR), **(extra or {})}
    raw = with_overrides(yaml.safe_load((d / "params.yaml").read_text()), overrides)
    (d / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    env = {**{k: v for k, v in os.environ.items()  # the copy's own sqlite store, this CPU's flags unless told
              if k not in ("MLFLOW_TRACKING_URI", "PIPELINE_CPU_FLAGS")},
           "PIPELINE_RUN_ID": "e2e-test",
           "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t", **(extra_env or {})}
    link_venv(d)  # the stages run .venv/bin/python (dvc.yaml): this test's venv
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "copy"]):
        subprocess.run(cmd, cwd=d, env=env, check=True)
    proc = subprocess.run([str(Path(sys.executable).parent / "dvc"), "repro"], cwd=d, env=env,
                          capture_output=True, text=True, timeout=1500)
    (d / "repro.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return d


@pytest.fixture(scope="session")
def repo(tmp_path_factory) -> Path:
    """A fresh copy of the project after a real `dvc repro` of the miniature profile: the one pipeline run of the
    session, shared by the e2e and model tiers.

    The miniature profile finetunes the real (packaged) all-MiniLM-L6-v2, cut to its first 3 layers, on a few
    hundred reviews, so the behaviour tests run against artifacts of a model that has actually learned sentiment.
    Its `auto` settings are decided with an AVX2-only CPU's flags (`PIPELINE_CPU_FLAGS`) on every machine, so the
    run rehearses what `make run` chooses on the least capable CPU the project supports (fp32 training, unsigned
    8-bit weights); the kernels still run on this CPU's ISA, and the bf16 timing row is left out as `auto` leaves
    it out there (an explicit row is timed on the tiny model in tests/unit/evaluation/test_latency.py); the opt-in
    parts (student, pruning, TensorRT input) stay off, as in the default.
    """
    return repro_copy(tmp_path_factory.mktemp("repo"), MINI_PROFILE, extra_env={FLAGS_OVERRIDE_ENV: AVX2_ONLY_FLAGS})


@pytest.fixture(scope="session")
def repo_opt_in(tmp_path_factory) -> Path:
    """Like `repo`, with the opt-in parts built too (`OPT_IN`): a second whole run, for the `slow` tests of
    tests/e2e/test_opt_in.py (`make test-all`)."""
    return repro_copy(tmp_path_factory.mktemp("repo-opt-in"), MINI_PROFILE, OPT_IN,
                      extra_env={FLAGS_OVERRIDE_ENV: AVX2_ONLY_FLAGS})
