"""`dvc.yaml` stays true: each stage's code deps are exactly the modules it imports (`pipeline.core.stage_deps`,
which `--write`s them), so an edit re-runs only the stages that run it; prepare depends on the local IMDB copy, and
the variant directories follow the catalog."""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path

import pytest
import yaml

from pipeline.core.stage_deps import READS, ROOT, code_deps, copied_files, import_closure, is_code_dep, main, rewrite
from pipeline.runtimes.catalog import built_by, with_directories

DVC_TEXT = (ROOT / "dvc.yaml").read_text()
DVC = yaml.safe_load(DVC_TEXT)["stages"]
BUILDER = Path("pipeline/variants/openvino_int8.py")
REPORT = Path("pipeline/evaluation/report.py")


def _covers(dep: Path, path: Path) -> bool:
    return path == dep or dep in path.parents


def _declared_code(stage: str) -> list[str]:
    return [str(d) for d in DVC[stage]["deps"] if is_code_dep(str(d))]


def _rerun_by(path: Path) -> set[str]:
    """The stages whose declared deps `dvc status` would see change after an edit of `path`."""
    return {s for s in DVC if any(_covers(Path(str(d)), path) for d in DVC[s]["deps"])}


@pytest.mark.parametrize("stage", sorted(DVC))
def test_declared_code_deps_are_the_import_closure(stage):
    """No module a stage imports is missing (an edit of it would not re-run the stage) and none is extra (an edit
    of it would re-run the stage for nothing)."""
    declared, wanted = _declared_code(stage), code_deps(stage)
    assert "pipeline/core/params.py" in wanted or "pipeline" in wanted  # the graph walk does reach the code
    missing, extra = sorted(set(wanted) - set(declared)), sorted(set(declared) - set(wanted))
    assert not missing and not extra, (
        f"stage {stage}: dvc.yaml lacks {missing} and lists {extra} it does not import; "
        "run `.venv/bin/python -m pipeline.core.stage_deps --write`")


def test_dvc_yaml_is_what_the_tool_writes():
    """The code deps are also in the tool's order (data deps first, code sorted), so `--write` changes nothing."""
    assert rewrite(DVC_TEXT) == DVC_TEXT
    assert main(["--check"]) == 0


def test_data_files_in_the_code_have_a_reader():
    """A file a module reads beside itself (a template) is a dep of the stages importing that module: each such
    file under pipeline/ or stages/ is claimed in `READS`, by a module that exists (the batch-scoring command's
    Spark module is imported by no stage: its file is a dep of none)."""
    data = [p.relative_to(ROOT) for top in ("pipeline", "stages") for p in (ROOT / top).rglob("*")
            if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts]
    read = [Path(f) for files in READS.values() for f in files]
    assert all((ROOT / m).is_file() for m in READS) and all((ROOT / f).exists() for f in read)
    assert Path("pipeline/evaluation/report.py") in import_closure("benchmark")  # a reader some stage imports
    assert [f for f in data if not any(_covers(r, f) for r in read)] == []


def test_editing_a_builder_reruns_no_training():
    """What `dvc status` sees after an edit of `pipeline/variants/openvino_int8.py` (the issue's check): finetune
    and prepare stay unchanged, and the stages that do re-run import it (or copy it, as package does)."""
    assert (ROOT / BUILDER).is_file()
    for stage in ("prepare", "finetune"):
        assert BUILDER not in import_closure(stage)
    rerun = _rerun_by(BUILDER)
    assert not {"prepare", "finetune", "export", "evaluate", "benchmark"} & rerun
    assert rerun == {s for s in DVC if BUILDER in import_closure(s) | copied_files(s)}, rerun
    assert "package" not in rerun  # the archive carries what the handler imports, and no builder


def test_editing_the_report_reruns_only_its_importers():
    """An edit of `pipeline/evaluation/report.py` re-runs exactly the stages whose import closure holds it (the
    archive copies only what the handler imports, so package is not one of them); no training and no build."""
    importers = {s for s in DVC if REPORT in import_closure(s)}
    assert importers == {"benchmark"}
    assert _rerun_by(REPORT) == importers


def _write_module(root: Path, rel: str, text: str) -> None:
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_text(text)


def test_closure_follows_runtime_imports_only(tmp_path):
    """Function-level imports and packages' code-holding `__init__.py` count; an `if TYPE_CHECKING:` import never
    runs and does not; a marker `__init__.py` is no dep."""
    _write_module(tmp_path, "stages/s.py", "from typing import TYPE_CHECKING\nimport pipeline.a\n"
                  "if TYPE_CHECKING:\n    from pipeline import typed\nelse:\n    import pipeline.other\n")
    _write_module(tmp_path, "pipeline/__init__.py", '"""A marker."""\nVERSION = "1"\n')
    _write_module(tmp_path, "pipeline/a.py", "def f():\n    from pipeline.sub import b\n")
    _write_module(tmp_path, "pipeline/sub/__init__.py", "import os\n")
    _write_module(tmp_path, "pipeline/sub/b.py", "")
    for rel in ("pipeline/typed.py", "pipeline/other.py", "pipeline/unused.py", "stages/__init__.py"):
        _write_module(tmp_path, rel, "")
    assert code_deps("s", tmp_path) == ["pipeline/a.py", "pipeline/other.py", "pipeline/sub/__init__.py",
                                        "pipeline/sub/b.py", "stages/s.py"]  # the empty stages/__init__.py: a marker


def test_rewrite_keeps_data_deps_and_comments(tmp_path):
    for rel in ("stages/s.py", "pipeline/a.py", "pipeline/b.py"):
        _write_module(tmp_path, rel, "import pipeline.a\n" if rel == "stages/s.py" else "")
    text = ("# header\nstages:\n  s:\n    cmd: python -m stages.s\n    deps:\n"
            "      - data/x   # the data\n      - pipeline/b.py\n      - pipeline/a.py  # kept\n"
            "      - ${data.local_dir}\n    outs:\n      - out\n")
    assert rewrite(text, tmp_path) == (
        "# header\nstages:\n  s:\n    cmd: python -m stages.s\n    deps:\n"
        "      - data/x   # the data\n      - ${data.local_dir}\n      - pipeline/a.py  # kept\n"
        "      - stages/s.py\n    outs:\n      - out\n")


def _placeholder(path: Path) -> None:
    """A file, or a directory holding one, where a dep or an out of the copy is not there."""
    if path.exists():
        return
    target = path if path.suffix else path / "placeholder"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("x")


def _changed_stages(repo: Path) -> set[str]:
    from dvc.repo import Repo

    with Repo(str(repo)) as dvc:
        return {key.split(":")[-1] for key in dvc.status()}


def test_dvc_status_after_edits(tmp_path, monkeypatch):
    """The issue's check with DVC itself (its Python API: no process start per command), in a copy with
    placeholder data that `dvc commit` records: an edit of the OpenVINO builder leaves prepare and finetune
    unchanged; an edit of the report changes only its importer."""
    from dvc.repo import Repo

    repo = tmp_path / "repo"
    for top in ("pipeline", "stages"):
        shutil.copytree(ROOT / top, repo / top, ignore=shutil.ignore_patterns("__pycache__"))
    for rel in ("dvc.yaml", "params.yaml", "serving/handler.py"):
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, repo / rel)
    params = yaml.safe_load((repo / "params.yaml").read_text())
    for stage in DVC.values():
        for entry in (*stage["deps"], *stage.get("outs", []), *stage.get("metrics", []), *stage.get("plots", [])):
            name = str(next(iter(entry)) if isinstance(entry, dict) else entry)
            _placeholder(repo / name.replace("${data.local_dir}", params["data"]["local_dir"]))
    monkeypatch.chdir(repo)  # DVC resolves a stage's paths against the working directory
    monkeypatch.setenv("DVC_SITE_CACHE_DIR", str(tmp_path / "site-cache"))  # DVC's state, not /var/tmp/dvc
    Repo.init(str(repo), no_scm=True).close()
    with Repo(str(repo)) as dvc:
        dvc.commit(force=True)  # nothing changed now: the edits below account for every stage `status` names
    original = (repo / BUILDER).read_text()
    (repo / BUILDER).write_text(original + "\n# an edit\n")
    changed = _changed_stages(repo)
    assert changed and not {"prepare", "finetune"} & changed, changed
    assert changed == _rerun_by(BUILDER)
    (repo / BUILDER).write_text(original)
    (repo / REPORT).write_text((repo / REPORT).read_text() + "\n# an edit\n")
    assert _changed_stages(repo) == {"benchmark"}


def test_prepare_depends_on_the_imdb_source():
    assert "${data.local_dir}" in DVC["prepare"]["deps"]
    assert "data" in DVC["prepare"]["params"]  # source, hub_name and hub_revision are recorded as params


@pytest.mark.parametrize("stage", ["export", "quantize", "prune", "tensorrt"])
def test_build_stage_outs_are_its_registry_rows(stage):
    outs = {str(o) for o in DVC[stage]["outs"]}
    assert outs == {f"models/variants/{v.name}" for v in built_by(stage)}
    assert "--variants-dir models/variants" in DVC[stage]["cmd"]


def test_distill_outs_are_the_student_and_its_registry_rows():
    outs = {str(o) for o in DVC["distill"]["outs"]}
    assert outs == {"models/distilled"} | {f"models/variants/{v.name}" for v in built_by("distill")}
    assert "--variants-dir models/variants" in DVC["distill"]["cmd"]
    assert "data/tokenized" in DVC["distill"]["deps"]  # where the transfer split lives


@pytest.mark.parametrize("stage", ["evaluate", "benchmark"])
def test_readers_depend_on_every_registered_variant(stage):
    deps = {str(d) for d in DVC[stage]["deps"]}
    assert {f"models/variants/{v.name}" for v in with_directories()} <= deps


def test_package_depends_on_every_servable_variant():
    deps = {str(d) for d in DVC["package"]["deps"]}
    assert {f"models/variants/{v.name}" for v in with_directories() if v.servable} <= deps


def test_every_stage_command_runs_the_project_interpreter():
    """A stage started by `.venv/bin/dvc` with another `python` first on PATH still runs in the project's venv:
    each command names `.venv/bin/python` (a bare `python` would be whatever PATH finds, e.g. the system one)."""
    for name, stage in DVC.items():
        assert stage["cmd"].startswith(f".venv/bin/python -m stages.{name} "), (name, stage["cmd"])


def _declared_paths(stage: dict) -> set[Path]:
    """Every path a stage declares: deps, outs, metrics and plots (each entry a path or a one-key mapping)."""
    entries = [*stage.get("deps", []), *stage.get("outs", []), *stage.get("metrics", []), *stage.get("plots", [])]
    return {Path(str(next(iter(e)) if isinstance(e, dict) else e)) for e in entries}


@pytest.mark.parametrize("stage", sorted(DVC))
def test_every_path_a_command_is_given_is_declared(stage):
    """Each path a stage's command names (the value of a `--option`) is declared as one of its deps, outs, metrics or
    plots, or is the folder declared entries sit in (`--variants-dir models/variants`); the params file is tracked as
    `params`. A file read or written but not declared would make `dvc repro` skip or keep a stale result."""
    args = DVC[stage]["cmd"].split()
    values = [value for option, value in itertools.pairwise(args)
              if option.startswith("--") and not value.startswith("--")]
    declared = _declared_paths(DVC[stage])
    undeclared = [v for v in values if v != "params.yaml"
                  and not any(_covers(d, Path(v)) or Path(v) in d.parents for d in declared)]
    assert not undeclared, f"{stage}: {undeclared} are given to the command but not declared in dvc.yaml"
    assert "params.yaml" not in values or DVC[stage].get("params"), stage
