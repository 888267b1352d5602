"""The project's two servers started as local processes on free loopback ports, for the tests and the benchmarks
that call real servers: any command in a process group of its own (`start_server`/`stop_server`: MLflow's scoring
server, nginx), and TorchServe as `make serve` starts it (`running_torchserve`: `serving/config.properties` with only
its ports and model store rewritten). Nothing here is imported by a server itself."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil

from serving.client import inference_key

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

#: Ports `free_port` handed out in this process: a server's several ports are never drawn twice.
_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now, drawn at random below the kernel's
    ephemeral range. A port the kernel picks itself (bind to 0) lies inside that range, where every outgoing
    connection also takes its local port: between this call and the server's bind (seconds, for TorchServe's JVM) a
    client of the other test worker could take it, and the server would fail with "Address already in use"."""

    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768  # Linux's default
    draw = random.SystemRandom()
    for _ in range(200):
        port = draw.randrange(10000, max(ephemeral_low, 10001))
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as s:  # below the range every port is taken: let the kernel choose
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(cmd: list[str], env: dict[str, str], cwd: Path, ready_url: str, log: Path,
                 timeout: float = 180) -> subprocess.Popen[bytes]:
    """Start `cmd` in a process group of its own (so `stop_server` ends it and every worker it spawned) and wait
    until `ready_url` answers 200; on failure the group is stopped and the log's tail is raised."""
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(ready_url, timeout=5) as resp:
                    if resp.status == 200:
                        return proc
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
    except BaseException:  # interrupted or failed while waiting: its own session would outlive this process
        stop_server(proc)
        raise
    stop_server(proc)
    raise TimeoutError(f"{cmd[:4]} not ready at {ready_url} (exit {proc.returncode}); log tail:\n"
                       f"{log.read_text(errors='replace')[-4000:]}")


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """End the process group `start_server` started: SIGTERM, SIGKILL if its leader is still there after 20 s,
    and SIGKILL for any worker of the group that outlived the leader."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


class RunningTorchServe:
    """Handle on a TorchServe `running_torchserve` started: its addresses, key and working directory."""

    def __init__(self, workdir: Path, url: str, key: str, variant_dir: Path, ports: dict[str, int]) -> None:
        self.workdir, self.url, self.key, self.variant_dir = workdir, url, key, variant_dir
        self.management_url = f"http://127.0.0.1:{ports['management']}"
        self.metrics_url = f"http://127.0.0.1:{ports['metrics']}"
        self.ports = ports

    def frontend_pids(self) -> set[int]:
        """The Java frontend serving this working directory."""
        return {p.pid for p in psutil.process_iter(["name", "cmdline"])
                if p.info["name"] == "java" and str(self.workdir) in " ".join(p.info["cmdline"] or [])}

    def post(self, body: bytes, content_type: str = "application/json", key: str | None = "default",
             model: str = "sentiment") -> tuple[int, str]:
        req = urllib.request.Request(
            f"{self.url}/predictions/{model}", data=body, method="POST", headers={"Content-Type": content_type}
        )
        token = self.key if key == "default" else key
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode("utf-8", "replace")

    def predict(self, payload: object) -> tuple[int, object]:
        status, text = self.post(json.dumps(payload).encode())
        return status, json.loads(text) if text else None


def _wait_healthy(url: str, key: str, log: Path, startup_log: Path, timeout: float = 180,
                  models: tuple[str, ...] = ("sentiment",)) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        startup = startup_log.read_text(errors="replace") if startup_log.is_file() else ""
        if "Address already in use" in startup:  # the frontend stops at once: no use waiting for it
            raise RuntimeError(f"TorchServe could not bind one of its ports; {startup_log} ends:\n{startup[-3000:]}")
        try:
            req = urllib.request.Request(f"{url}/ping", headers={"Authorization": f"Bearer {key}"})
            with urllib.request.urlopen(req, timeout=5) as resp:
                if json.loads(resp.read()).get("status") == "Healthy":
                    # /ping is healthy before the workers finish loading: wait for a real answer from each model
                    body = json.dumps({"text": "warm"}).encode()
                    for model in models:
                        r = urllib.request.Request(
                            f"{url}/predictions/{model}",
                            data=body,
                            method="POST",
                            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
                        )
                        with urllib.request.urlopen(r, timeout=30) as ok:
                            if ok.status != 200:
                                raise OSError(f"{model} answered {ok.status}")
                    return
        except (OSError, urllib.error.URLError, json.JSONDecodeError):
            pass
        time.sleep(1)
    raise TimeoutError(f"TorchServe not healthy after {timeout}s; log tail:\n{log.read_text()[-4000:]}")


def _rewritten(cfg: str, pattern: str, replacement: str, what: str) -> str:
    """`cfg` with the one line `pattern` matches replaced; a config with no such line, or several, is refused
    (TorchServe would bind the port it names, not the free one this process waits on)."""
    out, count = re.subn(pattern, replacement, cfg, flags=re.M)
    if count != 1:
        raise ValueError(f"the TorchServe config has {count} lines for {what}; exactly one is rewritten")
    return out


def torchserve_config(config: Path, ports: dict[str, int], store: Path) -> str:
    """`config` with its five listeners on `ports` (loopback) and its model store at `store`."""
    cfg = config.read_text()
    for api in ("inference", "management", "metrics"):
        cfg = _rewritten(cfg, rf"^{api}_address=http://127\.0\.0\.1:\d+$",
                         f"{api}_address=http://127.0.0.1:{ports[api]}", f"{api}_address on 127.0.0.1")
    for api in ("grpc_inference", "grpc_management"):
        cfg = _rewritten(cfg, rf"^{api}_port=\d+$", f"{api}_port={ports[api]}", f"{api}_port")
    return _rewritten(cfg, r"^model_store=.*$", f"model_store={store}", "model_store")


@contextlib.contextmanager
def running_torchserve(work: Path, variant_dir: Path, models: tuple[str, ...] = ("sentiment",),
                       config: Path = ROOT / "serving" / "config.properties",
                       timeout: float = 180) -> Iterator[RunningTorchServe]:
    """TorchServe started as `make serve` starts it (`config`, by default serving/config.properties, on free loopback
    ports, token authorization) on `work/model_store/<model>.mar` for each of `models` (each with the shipped
    model's worker and batching settings, answering at `/predictions/<model>`), answering within `timeout` seconds,
    stopped, with everything it started, on exit."""
    store = work / "model_store"
    ports = {name: free_port() for name in ("inference", "management", "metrics", "grpc_inference",
                                            "grpc_management")}
    cfg = torchserve_config(config, ports, store)
    if models != ("sentiment",):
        shipped = json.loads(re.search(r"^models=(.*)$", cfg, flags=re.M)[1])["sentiment"]
        entries = {m: {v: {**e, "marName": f"{m}.mar"} for v, e in shipped.items()} for m in models}
        cfg = re.sub(r"^models=.*$", lambda _: "models=" + json.dumps(entries), cfg, flags=re.M)
        cfg = re.sub(r"^load_models=.*$", "load_models=" + ",".join(f"{m}.mar" for m in models), cfg, flags=re.M)
    (work / "config.properties").write_text(cfg)
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "TMPDIR": str(work),
           "LOG_LOCATION": str(work / "logs"), "METRICS_LOCATION": str(work / "logs")}
    start = [str(BIN / "torchserve"), "--start", "--ncs", "--ts-config", str(work / "config.properties"),
             "--model-store", str(store), "--log-config", str(ROOT / "serving" / "log4j2.xml")]
    log = work / "server.log"
    try:
        with log.open("w") as fh:
            subprocess.run(start, cwd=work, env=env, stdout=fh, stderr=subprocess.STDOUT, check=True, timeout=120)
        deadline = time.time() + 60
        while not (work / "key_file.json").is_file() and time.time() < deadline:
            time.sleep(0.5)
        key = inference_key(work / "key_file.json")  # waits out a key file TorchServe is still writing
        if not key:
            raise TimeoutError(f"TorchServe wrote no key file within 60 s; see {log}")
        url = f"http://127.0.0.1:{ports['inference']}"
        _wait_healthy(url, key, work / "logs" / "ts_log.log" if (work / "logs").exists() else log, log,
                      timeout=timeout, models=models)
        yield RunningTorchServe(work, url, key, variant_dir, ports)
    finally:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            subprocess.run([str(BIN / "torchserve"), "--stop"], cwd=work, env=env, capture_output=True, timeout=120)
        left = []
        for proc in psutil.process_iter(["cmdline"]):  # nothing it started may outlive it
            with contextlib.suppress(psutil.Error):
                if str(work) in " ".join(proc.info["cmdline"] or []) and proc.pid != os.getpid():
                    proc.kill()
                    left.append(proc)
        psutil.wait_procs(left, timeout=20)
