"""The two real servers of the serving tier, started once per session on free loopback ports and stopped even
when a test fails: TorchServe (`server`) on a tiny-model `.mar` with `serving/config.properties` as shipped (only
ports and the model store rewritten), and MLflow's scoring server behind the contract (`champion`,
`python -m serving.mlflow_server`) on the same tiny model's fp32-onnx variant, registered and aliased in a SQLite
store by the evaluate and package stages' own code. Both run with `tests.factories.SERVING_LIMITS`."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipeline.core.params import MlflowParams, PackageParams, Params
from serving.local_servers import free_port, running_torchserve, start_server, stop_server
from tests.factories import ROOT, SERVING_LIMITS, evaluated_fp32_onnx, write_tokenized

BIN = Path(sys.executable).parent


@pytest.fixture(scope="session")
def server(tmp_path_factory, built):
    """TorchServe serving the tiny model's fp32-onnx `.mar` (registry version 7), as `make serve` starts it."""
    from pipeline.deployment.archive import build_archive
    from pipeline.selection import ServedChoice

    work = tmp_path_factory.mktemp("torchserve")
    variant = work / "v" / "fp32-onnx"
    shutil.copytree(built["dirs"]["fp32-onnx"], variant)
    build_archive(variant, ServedChoice("fp32-onnx", "test"), {"name": "imdb-sentiment", "version": "7"},
                  PackageParams(**SERVING_LIMITS), work / "model_store" / "sentiment.mar")
    with running_torchserve(work, variant) as handle:
        yield handle


#: The champion server's `--header-timeout` and `--body-timeout`: short, so its slow-client tests wait seconds.
CHAMPION_TIMEOUTS_S = 3.0


@pytest.fixture(scope="session")
def champion(tmp_path_factory, tiny_model_dir, built, tracking_store):
    """The tiny model's fp32-onnx variant evaluated, packaged as `imdb-sentiment@champion`, and
    `python -m serving.mlflow_server` serving `models:/imdb-sentiment@champion` with the test limits. It runs
    from a directory outside the checkout: the model carries its own code, only the launcher comes from it."""
    from pipeline.core.parent_run import start_tracking
    from pipeline.deployment.archive import run_package_stage

    work = tmp_path_factory.mktemp("mlflow-serve")
    store = tracking_store(work / "mlflow.db")
    # packaged with the test limits: the server enforces what the version's package run recorded
    params = Params(mlflow=MlflowParams(tracking_uri=store), package=PackageParams(**SERVING_LIMITS))
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(work)
        mp.setenv("PIPELINE_RUN_ID", "serving-test")
        # the stages' mlflow.set_tracking_uri (`start_tracking`) also exports the store as MLFLOW_TRACKING_URI,
        # which wins over params: set here, it is removed again on leaving, so no later session fixture logs into
        # this store
        mp.setenv("MLFLOW_TRACKING_URI", store)
        dirs = evaluated_fp32_onnx(work, tiny_model_dir, params, built["dirs"]["fp32-onnx"])
        manifest = run_package_stage(variants_root=work / "variants", variants_metrics=work / "variants.json",
                                     benchmark_metrics=work / "benchmark.json", mar=work / "sentiment.mar",
                                     manifest_path=work / "package.json", params=params,
                                     run_context=start_tracking(params.mlflow, run_id="serving-test"))
    port = free_port()
    serve_dir = work / "elsewhere"
    serve_dir.mkdir()
    (serve_dir / "params.yaml").write_text(yaml.safe_dump({"mlflow": {"tracking_uri": store},
                                                           "package": SERVING_LIMITS}))
    env = {**{k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}, "PYTHONPATH": str(ROOT),
           "PATH": f"{BIN}:{os.environ['PATH']}"}
    cmd = [sys.executable, "-m", "serving.mlflow_server", "--port", str(port), "--params", "params.yaml",
           "--log-dir", "logs", "--header-timeout", str(CHAMPION_TIMEOUTS_S), "--body-timeout",
           str(CHAMPION_TIMEOUTS_S)]
    proc = start_server(cmd, env, serve_dir, f"http://127.0.0.1:{port}/ready", work / "serve.log")
    try:
        yield {"url": f"http://127.0.0.1:{port}", "variant_dir": dirs["fp32-onnx"], "manifest": manifest,
               "mar": work / "sentiment.mar", "store": store, "log_dir": serve_dir / "logs",
               "params": serve_dir / "params.yaml", "timeouts_s": CHAMPION_TIMEOUTS_S}
    finally:
        stop_server(proc)


@contextlib.contextmanager
def nginx_in_front(upstream_port: int, work: Path) -> Iterator[str]:
    """`serving/nginx.conf` as the Docker image runs it, in front of `upstream_port` (only the listen ports, the
    upstream and the pid/temp paths rewritten, under `work`); its URL. Skipped where no nginx is installed."""
    import socket

    nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").is_file() else None)
    if nginx is None:
        pytest.skip("nginx is not installed here (the Docker image installs it)")
    port, hop = free_port(), free_port()
    conf = (ROOT / "serving" / "nginx.conf").read_text()
    conf = re.sub(r"listen 8080;", f"listen 127.0.0.1:{port};", conf)
    conf = re.sub(r"server 127\.0\.0\.1:8079;", f"server 127.0.0.1:{upstream_port};", conf)
    conf = conf.replace("127.0.0.1:8078", f"127.0.0.1:{hop}").replace("/tmp/", f"{work}/")
    (work / "nginx.conf").write_text(conf)
    proc = subprocess.Popen([nginx, "-c", str(work / "nginx.conf"), "-g", "daemon off;"], cwd=work,
                            stdout=subprocess.DEVNULL, stderr=(work / "nginx.log").open("wb"),
                            start_new_session=True)
    try:
        deadline = time.time() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError((work / "nginx.log").read_text()) from None
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_server(proc)


@pytest.fixture(scope="session")
def proxy(tmp_path_factory, server):
    """`serving/nginx.conf` in front of the session's TorchServe (`nginx_in_front`)."""
    with nginx_in_front(server.ports["inference"], tmp_path_factory.mktemp("nginx")) as url:
        yield url


def default_served_variant() -> str:
    """The variant the default profile's last `make run` serves, from its committed package metrics: the matrix
    always includes it, so a change of the served variant cannot leave it out."""
    manifest = ROOT / "metrics" / "package.json"
    if not manifest.is_file():
        pytest.fail(f"{manifest} is missing: the concurrency matrix reads the default run's served variant there")
    return json.loads(manifest.read_text())["variant"]


#: One servable variant of each runtime and batching path: onnxruntime batched (fp32-onnx) and row by row
#: (int8-dynamic), OpenVINO (int8-openvino), TorchScript; `default_served_variant()` is added to them.
MATRIX_VARIANTS = ("fp32-onnx", "int8-dynamic", "int8-openvino", "fp32-torchscript")


@pytest.fixture(scope="session")
def matrix(tmp_path_factory, tiny_model_dir, built, tracking_store):
    """The concurrency matrix's servers: the tiny model's `MATRIX_VARIANTS` plus the default's served variant, built
    by the export and quantize stages' own code (copied from `built`), logged as MLflow models by the evaluate
    stage's code, then one
    TorchServe holding one `.mar` per variant (`/predictions/<variant>`, the shipped worker and batching settings)
    and one `python -m serving.mlflow_server --model-uri <its model>` per variant, all with the default limits."""
    from concurrent.futures import ThreadPoolExecutor

    from pipeline.core.params import EvaluateParams, TargetsParams
    from pipeline.core.parent_run import start_tracking
    from pipeline.deployment.archive import build_archive
    from pipeline.evaluation.accuracy import log_variant_runs, score_variants
    from pipeline.runtimes.catalog import spec
    from pipeline.selection import ServedChoice

    served = default_served_variant()
    names = tuple(dict.fromkeys((*MATRIX_VARIANTS, served)))
    if spec(served).stage not in ("export", "quantize"):
        pytest.fail(f"the default serves {served} (built by the {spec(served).stage} stage): give the concurrency "
                    "matrix a builder for it in tests/serving/conftest.py")
    work = tmp_path_factory.mktemp("matrix")
    store = tracking_store(work / "mlflow.db")
    params = Params(mlflow=MlflowParams(tracking_uri=store))
    tok = write_tokenized(work / "tok", {"test": 16})
    dirs = {n: work / "variants" / n for n in names}
    for n in names:
        shutil.copytree(built["dirs"][n], dirs[n])
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(work)
        mp.setenv("MLFLOW_TRACKING_URI", store)  # removed on leaving (see `champion`)
        results = score_variants(tiny_model_dir, dirs, tok, EvaluateParams(), targets=TargetsParams())
        log_variant_runs(results, variant_dirs=dirs, finetuned=tiny_model_dir, params=params.evaluate,
                         run_context=start_tracking(params.mlflow, run_id="concurrency-matrix"),
                         serving=params.package)
    for n in names:
        build_archive(dirs[n], ServedChoice(n, "concurrency matrix"), {"name": "imdb-sentiment", "version": "1"},
                      params.package, work / "model_store" / f"{n}.mar")
    (work / "params.yaml").write_text(yaml.safe_dump({"mlflow": {"tracking_uri": store}}))
    env = {**{k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}, "PYTHONPATH": str(ROOT),
           "PATH": f"{BIN}:{os.environ['PATH']}"}

    def start_mlflow(name: str) -> tuple[str, Any]:
        port = free_port()
        cmd = [sys.executable, "-m", "serving.mlflow_server", "--port", str(port), "--params", "params.yaml",
               "--model-uri", results[name]["model_uri"], "--log-dir", f"logs-{name}"]
        return f"http://127.0.0.1:{port}", start_server(cmd, env, work, f"http://127.0.0.1:{port}/ready",
                                                         work / f"mlflow-{name}.log")

    with ThreadPoolExecutor(len(names)) as pool:
        started = [pool.submit(start_mlflow, n) for n in names]
        mlflow_servers = {}
        for n, future in zip(names, started, strict=True):
            with contextlib.suppress(Exception):
                mlflow_servers[n] = future.result()
    try:
        assert len(mlflow_servers) == len(names), [f.exception() for f in started if f.exception()]
        with running_torchserve(work, work / "variants", models=names) as torchserve:
            yield {"variants": names, "served": served, "dirs": dirs, "torchserve": torchserve,
                   "mlflow": {n: url for n, (url, _) in mlflow_servers.items()}, "limits": params.package}
    finally:
        for _, proc in mlflow_servers.values():
            stop_server(proc)
