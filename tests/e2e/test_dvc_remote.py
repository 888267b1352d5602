"""Data and models through a DVC remote, as docs/past-one-machine.md has a team do it: after the miniature run
(fixture `repo`) its author commits `dvc.lock` and adds a remote (a local folder here, S3 in the page), `dvc push`;
a colleague clones the repository, `dvc pull`s, and has every cached output without training: `dvc status` is
clean, `dvc repro` runs no stage, and the served archive is the author's, byte for byte, and answers as the
trained variant does. What DVC does not carry (MLflow's runs and registry) is checked to be absent from the clone.

The author's steps run in the session's `repo` copy itself (DVC's cache is there): a commit of the run's lock file
and small metrics, and a remote in `.dvc/config`; no stage output is changed, so the other tests of the copy read
the same files."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.factories import ROOT, link_venv

PAGE = ROOT / "docs" / "past-one-machine.md"
#: The remote's URL in the page; the test runs the same commands with a local folder in its place.
S3_URL = "s3://my-bucket/sentiment-pipeline"
#: The clone's URL in the page; the test clones the `repo` copy instead.
GIT_URL = "https://git.example.org/team/sentiment-pipeline.git"
#: What the page has the author run after `make run`, in order.
AUTHOR = [
    f".venv/bin/dvc remote add -d storage {S3_URL}",
    "git add dvc.lock .dvc/config metrics plots",
    'git commit -m "A run: its lock file, metrics and the DVC remote"',
    ".venv/bin/dvc push",
]
#: What the page has the colleague run in the clone, in order (after `make venv`, which the test replaces by a link
#: to its own environment, as `tests.conftest.repro_copy` does).
COLLEAGUE = [".venv/bin/dvc pull", ".venv/bin/dvc status", ".venv/bin/dvc repro"]


def run(command: str, cwd: Path, env: dict[str, str]) -> str:
    """One documented command, as written (`.venv/bin/...` resolves in `cwd`); its output, or the test fails."""
    proc = subprocess.run(shlex.split(command), cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{command}: exit {proc.returncode}\n{(proc.stdout + proc.stderr)[-4000:]}"
    return proc.stdout + proc.stderr


def cached_outputs(root: Path) -> dict[str, str]:
    """Path -> md5 of every output `dvc.lock` records with DVC's cache (what `dvc push` sends)."""
    dvc_yaml = yaml.safe_load((root / "dvc.yaml").read_text())
    uncached = {next(iter(o)) for stage in dvc_yaml["stages"].values()
                for section in ("outs", "metrics", "plots") for o in stage.get(section, [])
                if isinstance(o, dict) and next(iter(o.values())).get("cache") is False}
    lock = yaml.safe_load((root / "dvc.lock").read_text())
    return {o["path"]: o["md5"] for stage in lock["stages"].values() for o in stage.get("outs", [])
            if o["path"] not in uncached}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def colleague(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The author pushes the run to a folder remote; a colleague clones the repository and pulls, checks the status
    and reproduces. Returns the clone, the remote and each command's output."""
    work = tmp_path_factory.mktemp("dvc-remote")
    remote, clone = work / "remote", work / "clone"
    env = {**{k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "PIPELINE_CPU_FLAGS")},
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    outputs = {command: run(command.replace(S3_URL, str(remote)), repo, env) for command in AUTHOR}
    run(f"git clone -q {repo} {clone}", work, env)  # the page's `git clone GIT_URL`
    link_venv(clone)  # the page's `make venv`
    outputs |= {command: run(command, clone, env) for command in COLLEAGUE}
    return {"clone": clone, "remote": remote, "out": outputs}


def test_the_page_shows_the_commands_this_module_runs():
    page = PAGE.read_text(encoding="utf-8")
    for command in [*AUTHOR, f"git clone {GIT_URL}", "make venv", *COLLEAGUE, "make serve"]:
        assert command in page, command


def test_a_clone_pulls_every_cached_output_and_reruns_nothing(colleague, repo: Path):
    clone, out = colleague["clone"], colleague["out"]
    outputs = cached_outputs(repo)
    # the run's data, the finetuned model, every variant, the reports and the archive went to the remote
    assert {"data/tokenized", "models/finetuned", "models/variants/int8-dynamic",
            "model_store/sentiment.mar"} <= set(outputs)
    assert cached_outputs(clone) == outputs  # the clone's lock file is the run's
    assert not [path for path in outputs if not (clone / path).exists()]
    assert any((colleague["remote"] / "files" / "md5").rglob("*"))
    assert "Data and pipelines are up to date." in out[".venv/bin/dvc status"]
    # `dvc repro` ran no stage: every stage of dvc.yaml was found unchanged
    repro = out[".venv/bin/dvc repro"]
    stages = yaml.safe_load((clone / "dvc.yaml").read_text())["stages"]
    assert "Running stage" not in repro
    assert not [s for s in stages if f"Stage '{s}' didn't change, skipping" not in repro], repro[-3000:]
    # the metrics DVC does not cache came through git, unchanged
    for name in ("variants.json", "benchmark.json", "package.json"):
        assert sha256(clone / "metrics" / name) == sha256(repo / "metrics" / name)
    # MLflow's store is neither in git nor in DVC: the colleague gets no runs and no registry from the remote
    assert not (clone / "mlflow.db").exists() and not (clone / "mlruns").exists()


class Context:
    """What the TorchServe handler reads of its context: the unpacked archive's directory, each request's headers;
    what it writes: each answer's status and headers."""

    def __init__(self, model_dir: Path) -> None:
        self.system_properties = {"model_dir": str(model_dir)}
        self.statuses: dict[int, int] = {}

    def get_all_request_header(self, idx: int) -> dict[str, object]:
        return {"Content-Type": "application/json"}

    def get_request_id(self, idx: int = 0) -> str:
        return f"request-{idx}"

    def set_response_status(self, code: int, phrase: str = "", idx: int = 0) -> None:
        self.statuses[idx] = code

    def set_response_content_type(self, idx: int, value: str) -> None:
        pass

    def set_response_header(self, idx: int, key: str, value: str) -> None:
        pass


def test_the_pulled_archive_is_the_trained_one_and_serves(colleague, repo: Path, tmp_path: Path):
    """`make serve` needs only `model_store/sentiment.mar`: the clone's is the author's, byte for byte, and TorchServe's
    handler, given the archive unpacked as TorchServe unpacks it, answers as the trained variant does."""
    from pipeline.deployment.inference import SentimentPredictor
    from serving.handler import SentimentHandler

    mar = colleague["clone"] / "model_store" / "sentiment.mar"
    assert sha256(mar) == sha256(repo / "model_store" / "sentiment.mar")
    with zipfile.ZipFile(mar) as archive:
        archive.extractall(tmp_path / "model")
    handler, context = SentimentHandler(), Context(tmp_path / "model")
    handler.initialize(context)
    texts = ["a wonderful, moving film", "dull and far too long"]
    answers = [json.loads(a) for a in handler.handle([{"body": json.dumps({"text": t}).encode()} for t in texts],
                                                     context)]
    assert context.statuses == {0: 200, 1: 200}
    served = json.loads((repo / "metrics" / "package.json").read_text())["variant"]
    want = SentimentPredictor(repo / "models" / "variants" / served).predict(texts)
    assert [a["label"] for a in answers] == [w.label for w in want]
    assert [a["score"] for a in answers] == pytest.approx([w.score for w in want], abs=1e-5)
