"""The documentation: the site builds strictly (`mkdocs build --strict`: every relative link and #anchor of
README, RESULTS and docs/ resolves, every page is in the nav), the front pages stay short, and every shell command
the README and docs show names a real make target (and its variables), module (and its options), DVC stage,
settings key or file.

The command check reads the commands; it runs only what is cheap and side-effect free: settings assignments
(`pipeline.core.params set`, `dvc exp run -S`) and profiles are applied to a temporary copy of params.yaml by the
params CLI itself, so a key that does not exist or a value it refuses fails here.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from pipeline.core import params as params_cli

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", ROOT / "RESULTS.md", *sorted(DOCS.glob("*.md"))]

FENCE = re.compile(r"^(```+|~~~+)\s*([\w-]*)")
INLINE_CODE = re.compile(r"`+[^`]*`+")
SHELL_LANGUAGES = {"bash", "sh", "shell", "console"}
# Programs a documented command may start with, besides make, python and the venv's own tools.
PLAIN_PROGRAMS = {"curl", "git", "psql"}
VENV_TOOLS = {"dvc", "mlflow", "mkdocs", "ruff", "pytest", "torchserve"}
THIRD_PARTY_MODULES = {"pytest", "pip", "mkdocs"}
DVC_SUBCOMMANDS = {("metrics", "show"), ("plots", "show"), ("exp", "show"), ("repro",), ("exp", "run"),
                   ("remote", "add"), ("push",), ("pull",), ("status",)}
# First path components that are the repository's own files (outputs such as models/ or data/ are not checked).
SOURCE_DIRS = {"tests", "profiles", "serving", "benchmarks", "pipeline", "stages", "docs", ".ci"}


# ---- reading Markdown ------------------------------------------------------------------------------------------


def prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    fence = ""
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line.lstrip())
        if match and (not fence or match.group(1).startswith(fence)):
            fence = "" if fence else match.group(1)
            continue
        if not fence:
            yield number, line


def code_blocks(text: str, languages: set[str]) -> Iterator[str]:
    """The bodies of the fenced code blocks in one of `languages`."""
    fence, language, body = "", "", []
    for line in text.splitlines():
        match = FENCE.match(line.lstrip())
        if match and not fence:
            fence, language, body = match.group(1), match.group(2).lower(), []
        elif match and match.group(1).startswith(fence) and not match.group(2):
            if language in languages:
                yield "\n".join(body)
            fence = ""
        elif fence:
            body.append(line)


# ---- reading shell commands ------------------------------------------------------------------------------------


def shell_commands(text: str) -> Iterator[list[str]]:
    """Every simple command (tokens) of the shell code blocks: continuation lines joined, comments dropped,
    split at `&&`, `||`, `;`, `|` and `&`."""
    for block in code_blocks(text, SHELL_LANGUAGES):
        for line in block.replace("\\\n", " ").splitlines():
            lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            command: list[str] = []
            for token in lexer:
                if token in {"&&", "||", ";", "|", "&"}:
                    if command:
                        yield command
                    command = []
                else:
                    command.append(token)
            if command:
                yield command


INLINE_COMMAND = re.compile(r"^([A-Z_][A-Z0-9_]*=\S+ )*(make |\.venv/bin/|python3? -m )")


def inline_commands(text: str) -> Iterator[list[str]]:
    """Commands written as inline code in prose (`make run PROFILE=cpu-long`), except placeholders (`<name>`,
    `...`) and alternatives (`a|b`), which are not runnable as written."""
    for _, line in prose_lines(text):
        for span in re.findall(r"(?<!`)`([^`]+)`(?!`)", line):
            if INLINE_COMMAND.match(span) and not re.search(r"<|\.\.\.|\||DIR\b", span):
                yield from shell_commands(f"```bash\n{span}\n```")


def make_targets_and_variables() -> tuple[set[str], str]:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    return set(re.findall(r"^([A-Za-z][\w-]*)\s*:(?!=)", text, re.MULTILINE)), text


def read_from_environment(name: str) -> bool:
    """Whether the project's code reads the environment variable `name` (a variable set before `make`)."""
    code = (ROOT / package for package in ("pipeline", "stages", "serving", "benchmarks"))
    return any(name in path.read_text(encoding="utf-8") for package in code for path in package.rglob("*.py"))


def module_source(module: str) -> str | None:
    """The source of a repository module run with `python -m`, or None if there is none."""
    base = ROOT.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__main__.py"):
        if path.is_file():
            return path.read_text(encoding="utf-8")
    return None


def apply_settings(assignments: list[str], tmp_dir: Path) -> str | None:
    """Apply `key=value` assignments to a copy of params.yaml with the params CLI; its refusal, or None."""
    copy = tmp_dir / "params.yaml"
    copy.write_text((ROOT / "params.yaml").read_text(encoding="utf-8"), encoding="utf-8")
    return run_params_cli(["--params", str(copy), "set", *assignments])


def run_params_cli(argv: list[str]) -> str | None:
    try:
        params_cli.main(argv)
    except (SystemExit, Exception) as error:  # the CLI's refusal, whatever its type, is the finding
        if isinstance(error, SystemExit) and error.code in (0, None):
            return None
        return f"{type(error).__name__}: {error}"
    return None


def stage_flags(module: str) -> set[str] | None:
    """The option names of a stage's typed entry point (`stages.<name>`, built from its signature by
    `pipeline.core.stage.stage_command`); None for any other module, whose options are looked up in its source."""
    if not module.startswith("stages."):
        return None
    import importlib

    from pipeline.core.stage import stage_command

    name = module.split(".", 1)[1]
    stage = importlib.import_module(module)
    return {flag for param in stage_command(name, getattr(stage, name)).params for flag in param.opts}


def check_command(tokens: list[str], tmp_dir: Path) -> list[str]:
    """What is wrong with one documented command: an empty list when everything it names exists."""
    shown = shlex.join(tokens)
    env = []
    while tokens and re.match(r"^[A-Z_][A-Z0-9_]*=", tokens[0]):
        env.append(tokens.pop(0).partition("=")[0])
    if not tokens:
        return []
    program, args = tokens[0], tokens[1:]
    if program == "sudo":  # `sudo -u USER command ...`: the command it runs is what is checked
        command = args[2:] if args[:1] == ["-u"] else args
        return check_command(command, tmp_dir) if command else [f"{shown}: sudo runs nothing"]
    problems: list[str] = []
    for arg in args:
        first = arg.split("/")[0]
        if "/" in arg and first in SOURCE_DIRS and not (ROOT / arg.split("::")[0]).exists():
            problems.append(f"{shown}: no file {arg}")

    if program == "make":
        targets, makefile = make_targets_and_variables()
        for name in env:
            if f"$({name})" not in makefile and not read_from_environment(name):
                problems.append(f"{shown}: neither the Makefile nor the code reads {name}")
        for arg in args:
            name, is_assignment, value = arg.partition("=")
            if not is_assignment:
                if arg not in targets:
                    problems.append(f"{shown}: no make target {arg}")
            elif f"$({name})" not in makefile:
                problems.append(f"{shown}: the Makefile does not use {name}")
            elif name == "PROFILE":
                profile = ROOT / "profiles" / f"{value}.yaml"
                refused = run_params_cli(["overrides", str(profile)]) if profile.is_file() else "no such file"
                if refused:
                    problems.append(f"{shown}: profile {value}: {refused}")
        return problems

    if program in {"python", "python3", ".venv/bin/python"}:
        if args[:1] == ["-c"]:
            return problems
        if args[:1] != ["-m"] or len(args) < 2:
            return [*problems, f"{shown}: expected `python -m MODULE`"]
        module, options = args[1], args[2:]
        if module in THIRD_PARTY_MODULES:
            return problems
        source = module_source(module)
        if source is None:
            return [*problems, f"{shown}: no module {module}"]
        if "__main__" not in source:
            problems.append(f"{shown}: {module} has no `if __name__ == \"__main__\"`")
        flags = stage_flags(module)
        for option in options:
            flag = option.partition("=")[0]
            known = flag in flags if flags is not None else f'"{flag}"' in source or f"'{flag}'" in source
            if flag.startswith("--") and not known:
                problems.append(f"{shown}: {module} has no option {flag}")
        settings = options[1:] if module == "pipeline.core.params" and options[:1] == ["set"] else []
        if module == "benchmarks.distill_tradeoff":  # --config NAME:key=value,key=value
            configs = [options[i + 1] for i, o in enumerate(options[:-1]) if o == "--config"]
            settings = [a for c in configs for a in c.partition(":")[2].split(",") if a]
        refused = apply_settings(settings, tmp_dir) if settings else None
        if refused:
            problems.append(f"{shown}: {refused}")
        return problems

    if program.startswith(".venv/bin/"):
        tool = program.removeprefix(".venv/bin/")
        requirements = (ROOT / "requirements.txt").read_text(encoding="utf-8").lower()
        if tool not in VENV_TOOLS or f"\n{tool}==" not in f"\n{requirements}":
            return [*problems, f"{shown}: {tool} is not a pinned tool of the venv"]
        if tool == "dvc":
            words = [a for a in args if not a.startswith("-")]
            if not any(tuple(words[: len(sub)]) == sub for sub in DVC_SUBCOMMANDS):
                problems.append(f"{shown}: not a documented dvc subcommand")
            stages = yaml.safe_load((ROOT / "dvc.yaml").read_text(encoding="utf-8"))["stages"]
            if words[:1] == ["repro"]:
                problems += [f"{shown}: no DVC stage {s}" for s in words[1:] if s not in stages]
            settings = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "-S"]
            refused = apply_settings(settings, tmp_dir) if settings else None
            if refused:
                problems.append(f"{shown}: {refused}")
        return problems

    if program == "docker":
        if args[:1] == ["build"] and not (ROOT / "Dockerfile").is_file():
            problems.append(f"{shown}: no Dockerfile")
        return problems
    if program == "bash":
        return problems if args and (ROOT / args[-1]).is_file() else [*problems, f"{shown}: no script"]
    if program in PLAIN_PROGRAMS:
        return problems
    return [*problems, f"{shown}: unknown program {program} (teach tests/unit/test_docs.py what to check)"]


# ---- the tests -------------------------------------------------------------------------------------------------


def test_site_builds_strictly(tmp_path: Path) -> None:
    """`make docs`'s build: a broken link or anchor, a missing page or one left out of the nav fails it."""
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for page in ("index.html", "results/index.html", "serving/index.html", "mlflow-models.png"):
        assert (site / page).is_file(), page


def test_the_strict_build_fails_on_a_broken_link_or_anchor(tmp_path: Path) -> None:
    """The build above can fail: a site with the project's link validation, one missing page and one missing
    anchor, is refused by `mkdocs build --strict` (so no hand-written link checker is needed beside it)."""
    validation = re.search(r"^validation:\n(?:[ ]{2}.*\n)+", (ROOT / "mkdocs.yml").read_text(), re.MULTILINE)
    assert validation, "mkdocs.yml has no validation block"
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\n[gone](missing.md)\n", encoding="utf-8")
    (docs / "other.md").write_text("# Other\n\n[bad anchor](index.md#no-such-section)\n", encoding="utf-8")
    (tmp_path / "mkdocs.yml").write_text("site_name: t\nstrict: true\nnav:\n  - index.md\n  - other.md\n"
                                         + validation.group(0), encoding="utf-8")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode != 0
    assert "missing.md" in result.stderr and "no-such-section" in result.stderr, result.stderr


def test_front_pages_stay_short() -> None:
    """Issue 35: README is a front page (both set-up commands within its first 40 lines), RESULTS one page."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    results = (ROOT / "RESULTS.md").read_text(encoding="utf-8")
    assert len(readme) <= 12_000, len(readme)
    assert len(results) <= 15_000, len(results)
    head = readme.splitlines()[:40]
    for command in ("make run", "make test"):
        assert any(line.strip().startswith(command) for line in head), command


#: How a measurement shows itself in source text: the CPU it ran on, the day, a rate or a tolerance figure "on" a CPU.
MEASUREMENT = re.compile(r"\bZen ?\d\b|\b20\d\d-\d\d-\d\d\b|\d+(\.\d+)? reviews/s\b|\de-\d+ on an? ")


def test_source_comments_keep_the_why_and_leave_the_figures_to_the_docs() -> None:
    """House rule: a comment or docstring says why, and points to docs/ (or RESULTS) for what was measured; a
    figure copied into the code goes stale where no measurement updates it."""
    sources = [*sorted((ROOT / "pipeline").rglob("*.py")), *sorted((ROOT / "stages").glob("*.py")),
               *sorted((ROOT / "benchmarks").glob("*.py"))]
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for path in sources for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if MEASUREMENT.search(line)]
    assert not found, "\n".join(found)


def documented_commands() -> list[tuple[str, list[str]]]:
    return [
        (page.name, tokens)
        for page in PAGES
        for reader in (shell_commands, inline_commands)
        for tokens in reader(page.read_text(encoding="utf-8"))
    ]


def test_readme_shows_the_commands_to_run_serve_and_call() -> None:
    shown = {shlex.join(tokens) for name, tokens in documented_commands() if name == "README.md"}
    for expected in ("make run", "make test", "make serve", "make serve-mlflow", "make mlflow-ui"):
        assert expected in shown, expected
    assert any(c.startswith(".venv/bin/python -m serving.client") for c in shown)
    assert any(c.startswith("curl") and "/predictions/sentiment" in c for c in shown)
    assert any(c.startswith("curl") and "/invocations" in c for c in shown)


def test_every_documented_command_names_real_things(tmp_path: Path) -> None:
    commands = documented_commands()
    assert len(commands) > 20  # the blocks were found at all
    problems = [f"{name}: {p}" for name, tokens in commands for p in check_command(list(tokens), tmp_path)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("command, finding", [
    ("make nosuchtarget", "no make target nosuchtarget"),
    ("make run NOSUCHVAR=1", "does not use NOSUCHVAR"),
    ("NOSUCHVAR=1 make run", "nor the code reads NOSUCHVAR"),
    ("make run PROFILE=nosuch", "profile nosuch"),
    (".venv/bin/python -m benchmarks.nosuch", "no module benchmarks.nosuch"),
    (".venv/bin/python -m benchmarks.serve_load --no-such-option 3", "no option --no-such-option"),
    (".venv/bin/python -m pipeline.core.params set train.no_such_key=1", "no_such_key"),
    (".venv/bin/dvc exp run -S train.no_such_key=2", "no_such_key"),
    (".venv/bin/python -m benchmarks.distill_tradeoff --config d9:distill.no_such_key=1", "no_such_key"),
    (".venv/bin/dvc repro nosuchstage", "no DVC stage nosuchstage"),
    (".venv/bin/python -m pytest tests/unit/no_such_test.py", "no file tests/unit/no_such_test.py"),
    ("wget http://example.org", "unknown program wget"),
    ("sudo -u postgres wget http://example.org", "unknown program wget"),
    (".venv/bin/dvc remote list", "not a documented dvc subcommand"),
])
def test_command_check_finds_a_stale_command(command: str, finding: str, tmp_path: Path) -> None:
    """The command check can fail: each stale command is reported with what is wrong."""
    text = f"```bash\n{command}   # a comment\n```\n"
    problems = [p for tokens in shell_commands(text) for p in check_command(tokens, tmp_path)]
    assert any(finding in p for p in problems), problems


def test_make_mlflow_ui_opens_the_store_the_stages_log_to():
    """`make mlflow-ui` takes the tracking store as the stages do, `$MLFLOW_TRACKING_URI` first: for a tracking
    server it prints that server's UI and starts nothing (before, it always opened a local `mlflow.db`)."""
    env = {**os.environ, "MLFLOW_TRACKING_URI": "http://127.0.0.1:9/"}
    done = subprocess.run(["make", "-s", "mlflow-ui"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "its UI: http://127.0.0.1:9/" in done.stdout and "sqlite" not in done.stdout


def test_the_readmes_fp32_accuracy_is_the_committed_runs():
    """The headline's "FP32 at N %" is what the committed `metrics/finetune.json` (the run whose `dvc.lock` is
    committed) says: a re-run that moves it must move the README with it."""
    import json

    said = re.search(r"FP32 at (\d+\.\d\d) %", (ROOT / "README.md").read_text(encoding="utf-8"))
    assert said, "README.md no longer states the FP32 test accuracy"
    measured = json.loads((ROOT / "metrics" / "finetune.json").read_text())["test_accuracy"]
    assert f"{100 * measured:.2f}" == said[1]
