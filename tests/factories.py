"""Helpers shared by test modules: repository paths and synthetic review data in the pipeline's layouts.

Import from here (`from tests.factories import write_tokenized`), never from a conftest: conftest modules
hold fixtures only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from serving.local_servers import free_port

if TYPE_CHECKING:
    import socket

    from pipeline.core.machine import Choice
    from pipeline.core.params import Params
    from pipeline.deployment.protocol import Limits

ROOT = Path(__file__).resolve().parents[1]
IMDB_DIR = Path(os.environ.get("IMDB_DIR", ROOT.parent / "shared" / "data" / "imdb"))
#: An AVX2-only CPU's flags, as `PIPELINE_CPU_FLAGS` takes them (a Zen 3 lists these and no AVX-512, VNNI, bf16 or
#: AMX).
AVX2_ONLY_FLAGS = "sse4_2 avx avx2 fma f16c bmi2"


def shared_across_workers(base: Path, name: str, build: Callable[[Path], None]) -> Path:
    """`base/name`, built by `build` once for the whole test session, whichever pytest-xdist worker asks first: the
    others wait on a file lock, then read it. `base` is the session's temporary root, which every worker's own
    temporary directory sits in (pytest's `tmp_path_factory.getbasetemp()`, its parent under xdist). A build that
    failed or was killed part-way leaves no completion mark, so the next asker starts it again from nothing; readers
    must not write into it."""
    from filelock import FileLock

    directory = base / name
    with FileLock(str(directory) + ".lock"):
        if not (directory / ".complete").is_file():
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir(parents=True)
            build(directory)
            (directory / ".complete").touch()
    return directory


def link_venv(project: Path) -> Path:
    """`project/.venv` for a copy of the project to run this test session's venv through: `bin/python*` are scripts
    that exec this venv's interpreter, every other `bin/` entry (dvc, mlflow: scripts whose first line names that
    interpreter) a link to it. A symlink to the venv itself would work too, but Python would see the venv under the
    copy's path, and NNCF's extension (whose compile command holds the venv's paths) would be built again for it."""
    real = Path(sys.prefix) / "bin"
    bin_dir = project / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for entry in real.iterdir():
        if entry.name.startswith("python"):
            (bin_dir / entry.name).write_text(f'#!/bin/sh\nexec {shlex.quote(str(entry))} "$@"\n')
            (bin_dir / entry.name).chmod(0o755)
        else:
            (bin_dir / entry.name).symlink_to(entry)
    return project / ".venv"


def migrated_tracking_store(directory: Path) -> None:
    """`directory/mlflow.db`: an MLflow SQLite store as MLflow leaves a new database after migrating its schema, less
    the Default experiment, which MLflow creates on the next open at that store's own location."""
    import sqlite3

    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    store = SqlAlchemyStore(f"sqlite:///{directory / 'mlflow.db'}", str(directory / "mlruns"))
    store.engine.dispose()
    with contextlib.closing(sqlite3.connect(directory / "mlflow.db")) as db, db:
        db.execute("DELETE FROM experiments")


def synthetic_reviews(n: int, seed: int = 0) -> pd.DataFrame:
    """Short labelled reviews whose sentiment is carried by a few words (learnable in seconds)."""
    rng = np.random.default_rng(seed)
    pos = ["great", "wonderful", "excellent", "loved", "brilliant"]
    neg = ["awful", "terrible", "boring", "hated", "dreadful"]
    filler = ["the", "movie", "plot", "actors", "was", "really", "and", "film", "story", "scenes"]
    rows = []
    for i in range(n):
        label = int(i % 2)
        words = list(rng.choice(filler, size=int(rng.integers(3, 24))))
        for _ in range(3):  # a strong signal, so a random 2-layer BERT learns it in a few dozen steps
            words.insert(int(rng.integers(0, len(words) + 1)), str(rng.choice(pos if label else neg)))
        rows.append((" ".join(words) + f" #{i}", label))
    return pd.DataFrame(rows, columns=["text", "label"])


def write_tokenized(directory: Path, sizes: dict[str, int], max_length: int = 64) -> Path:
    """Tokenized synthetic splits in the prepare stage's layout (`{split}.parquet`, and the `tokenizer/`)."""
    from pipeline.core.params import DataParams, ModelParams
    from pipeline.data.tokens import tokenize_frame
    from pipeline.modeling import load_tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(ModelParams(source="tiny"))
    for seed, (split, n) in enumerate(sizes.items(), start=1):
        frame = tokenize_frame(synthetic_reviews(n, seed), tok, DataParams(max_length=max_length))
        frame.to_parquet(directory / f"{split}.parquet")
    tok.save_pretrained(directory / "tokenizer")  # as the prepare stage saves it beside the splits
    return directory


#: The limits both test servers run with (`package.*`): small, so every limit can be crossed cheaply, and a text's
#: limit below the body's, so a too-long text is refused for itself.
SERVING_LIMITS = {"max_texts": 4, "max_body_bytes": 4096, "max_chars_per_text": 1500, "max_json_depth": 8}


def limits(**overrides: int) -> Limits:
    """The endpoint's limits as the default profile sets them (`PackageParams`), with `overrides`."""
    from pipeline.core.params import PackageParams
    from pipeline.deployment.protocol import Limits

    return Limits.from_config({**vars(PackageParams()), **overrides})


def read_until_closed(sock: socket.socket) -> tuple[bytes, float]:
    """Everything a server sends on the socket `sock` until it closes the connection, and the seconds that took."""
    import time

    start, data = time.monotonic(), b""
    while chunk := sock.recv(4096):
        data += chunk
    return data, time.monotonic() - start


def wait_for_file(path: Path, proc: Any = None, timeout_s: float = 60.0) -> bool:
    """Wait until `path` exists (a marker a subprocess writes once it has reached a point), `proc` (a `Popen`) has
    exited, or `timeout_s` passed; returns whether the file is there."""
    import time

    deadline = time.monotonic() + timeout_s
    while not path.exists() and (proc is None or proc.poll() is None) and time.monotonic() < deadline:
        time.sleep(0.05)
    return path.exists()


@contextmanager
def uvicorn_in_thread(app: Any, protocol: Any, **config: Any) -> Iterator[int]:
    """`app` under uvicorn with the HTTP `protocol` class (`serving.request_deadline`'s), in a thread, on a free
    loopback port (yielded); `config`: more `uvicorn.Config` options. Stopped afterwards."""
    import threading
    import time

    import uvicorn

    port = free_port()
    # log_config None: uvicorn's own logging config would replace the handlers a test put on its loggers
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, http=protocol, lifespan="off",
                                           log_level="warning", log_config=None, **config))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(10)


def chunked_body(pieces: list[bytes]) -> bytes:
    """`pieces` as the chunks of an HTTP/1.1 chunked body, with its last (empty) chunk."""
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


def qat_precision_here(params: Params | None = None) -> Choice:
    """`quantize.qat_precision` of `params` (default: the defaults) as a stage on this machine resolves it."""
    from pipeline.core.params import Params, resolve_auto

    return resolve_auto(params or Params()).qat_precision


def weight_format_here(params: Params | None = None) -> Choice:
    """`quantize.weight_format` of `params` (default: the defaults) as a stage on this machine resolves it once
    (`resolve_auto`) and hands it to the builders."""
    from pipeline.core.params import Params, resolve_auto

    return resolve_auto(params or Params()).weight_format


def evaluated_fp32_onnx(work: Path, tiny_model_dir: Path, params: Params, fp32_onnx: Path) -> dict[str, Path]:
    """The tiny model's fp32-onnx variant (a copy of `fp32_onnx`, as the export stage wrote it), scored and logged by
    the evaluate stage's MLflow code (to the store `params.mlflow` or `$MLFLOW_TRACKING_URI` names), with
    `variants.json` and a stand-in `benchmark.json` written under `work`, as the package stage reads them, under
    the parent run of the execution `$PIPELINE_RUN_ID` names, set up as the evaluate stage sets it up
    (`start_tracking`). Returns the variant directories."""
    import os

    from pipeline.core.io import write_json
    from pipeline.core.params import EvaluateParams, TargetsParams
    from pipeline.core.parent_run import start_tracking
    from pipeline.core.run_id import pipeline_run_id
    from pipeline.evaluation.accuracy import log_variant_runs, score_variants

    tok = write_tokenized(work / "tok", {"test": 16})
    dirs = {"fp32-onnx": work / "variants" / "fp32-onnx"}
    shutil.copytree(fp32_onnx, dirs["fp32-onnx"])
    results = score_variants(tiny_model_dir, dirs, tok, EvaluateParams(), targets=TargetsParams())
    log_variant_runs(results, variant_dirs=dirs, finetuned=tiny_model_dir, params=params.evaluate,
                     run_context=start_tracking(params.mlflow, run_id=pipeline_run_id(os.environ)),
                     serving=params.package)
    write_json(work / "variants.json", results)
    write_json(work / "benchmark.json", {"fp32-eager": {"status": "ok", "p50_ms_b1": 5.0},
                                         "fp32-onnx": {"status": "ok", "p50_ms_b1": 4.0}})
    return dirs


def product_weights(path: Path) -> list[np.ndarray]:
    """The integer weight matrices of an INT8 ONNX file's matrix products (what `quantize.weight_format` decides):
    the weight operand of MatMulInteger/QAttention, and each DequantizeLinear'd initializer that feeds a MatMul or
    Gemm. Embedding tables (read by Gather, never multiplied) and zero points are left out."""
    import onnx
    from onnx import numpy_helper

    graph = onnx.load(str(path)).graph
    inits = {i.name: i for i in graph.initializer}
    consumers: dict[str, list[str]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node.op_type)
    names = []
    for node in graph.node:
        if node.op_type in ("MatMulInteger", "QAttention") and node.input[1] in inits:
            names.append(node.input[1])
        elif (node.op_type == "DequantizeLinear" and node.input[0] in inits
              and any(op in ("MatMul", "Gemm") for op in consumers.get(node.output[0], []))):
            names.append(node.input[0])
    return [numpy_helper.to_array(inits[n]) for n in dict.fromkeys(names)]


def tiny_classifier(layers: int = 4) -> Any:
    """A randomly initialised tiny BERT classifier (seed 0) with `layers` encoder layers, in eval mode."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from pipeline.modeling import tiny_bert_config

    torch.manual_seed(0)
    return AutoModelForSequenceClassification.from_config(tiny_bert_config(layers=layers)).eval()


def concurrently(call: Any, count: int, threads: int) -> list[Any]:
    """`call(i)` for i in range(count) from `threads` threads, the first `threads` calls released together (a
    barrier), so that many really run at once; results in order of i."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    barrier = threading.Barrier(threads)

    def first_wait(i: int) -> Any:
        if i < threads:
            barrier.wait()
        return call(i)

    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(first_wait, range(count)))


@contextmanager
def log_records(*names: str, level: int = logging.NOTSET) -> Iterator[list[logging.LogRecord]]:
    """Every record of at least `level` that the loggers `names` handle while the context runs, in order.

    A handler on each logger itself, not pytest's `caplog` (a handler on the root logger): it also sees loggers that
    do not propagate (transformers' own) and records that a stage's logging filters let through."""
    records: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Collect(level)
    loggers = [logging.getLogger(name) for name in names]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield records
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
