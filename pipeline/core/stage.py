"""Shared plumbing for stage entry points: logging set-up and turning known failures into clean exits."""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable

from pipeline.core.errors import UserError

#: Failures whose message already tells the user what to do, shown without a traceback: every `UserError`
#: (`ParamsError` included) and a missing file.
USER_FAILURES: tuple[type[BaseException], ...] = (UserError, FileNotFoundError)


class QuietThirdPartyRootInfo(logging.Filter):
    """Drops INFO/DEBUG lines that a library sends through the *root* logger (`logging.info(...)`).

    onnxruntime's quantizer does this (~40 per-tensor lines per build); a named logger could simply be
    set to WARNING, the root one cannot without hiding our own INFO lines.
    """

    def __init__(self, packages: tuple[str, ...] = ("onnxruntime",)) -> None:
        super().__init__()
        self.packages = packages

    def filter(self, record: logging.LogRecord) -> bool:
        from_package = any(f"{os.sep}{p}{os.sep}" in record.pathname for p in self.packages)
        return not (record.name == "root" and record.levelno < logging.WARNING and from_package)


def setup_logging() -> None:
    """Console logging for a stage process (called from `main`, never at import)."""
    logging.basicConfig(level=os.environ.get("LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("urllib3", "alembic", "httpx", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.getLogger("torchao").setLevel(logging.ERROR)  # "skipping its C++ kernels": see the Makefile
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, QuietThirdPartyRootInfo) for f in handler.filters):
            handler.addFilter(QuietThirdPartyRootInfo())


def what_it_does() -> str:
    """The first line of the running stage module's docstring (`python -m stages.<name>`), for the progress line."""
    doc = getattr(sys.modules.get("__main__"), "__doc__", None) or ""
    first = doc.strip().splitlines()[0] if doc.strip() else ""
    return first.split(": ", 1)[-1] if first.startswith("DVC stage") else first


def run_stage(name: str, body: Callable[[], None]) -> None:
    """Run a stage body between two progress lines (what it does; how long it took, or how it failed); a user
    error (`USER_FAILURES`) ends the process with exit 2 and one clear line."""
    setup_logging()
    log = logging.getLogger("pipeline.stage")
    started = time.perf_counter()
    log.info("==> %s: %s", name, what_it_does() or "started")
    outcome = "failed"
    try:
        body()
        outcome = "done"
    except USER_FAILURES as exc:
        print(f"error: stage '{name}' failed: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except SystemExit as exc:  # e.g. a preempted training job: exit 128 + signal, checkpoint written
        outcome = f"stopped (exit {exc.code})"
        raise
    finally:
        seconds = time.perf_counter() - started
        log.info("<== %s %s in %.1f s", name, outcome, seconds)
        record_stage_time(name, outcome, seconds)


#: Where each stage process appends its wall time (`make run`'s summary reads it); a log, not a DVC output.
STAGE_LOG_ENV = "PIPELINE_STAGE_LOG"
STAGE_LOG = "logs/stages.jsonl"


def record_stage_time(name: str, outcome: str, seconds: float) -> None:
    """Append one line (pipeline run id, stage, outcome, seconds) to `$PIPELINE_STAGE_LOG` or `logs/stages.jsonl`;
    a log that cannot be written costs the summary a row, never the stage."""
    import json

    from pipeline.core.run_id import pipeline_run_id

    path = os.environ.get(STAGE_LOG_ENV, STAGE_LOG)
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"run_id": pipeline_run_id(), "stage": name, "outcome": outcome,
                                "seconds": round(seconds, 1), "at": time.time()}) + "\n")
    except OSError as exc:
        logging.getLogger("pipeline.stage").warning("stage time not logged to %s: %s", path, exc)
