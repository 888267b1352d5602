"""The one way a stage runs: its typed command line (`stage_main`), its params loaded, every `auto` resolved and
its pipeline execution identified once (`StageContext`: the run id, and the MLflow run context on first use),
progress lines and its wall time, and known failures turned into clean exits."""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from pipeline.core.errors import UserError

if TYPE_CHECKING:
    from types import FrameType

    import click

    from pipeline.core.params import Params, ResolvedAuto
    from pipeline.core.parent_run import RunContext

#: Failures whose message already tells the user what to do, shown without a traceback: every `UserError`
#: (`ParamsError` included) and a missing file.
USER_FAILURES: tuple[type[BaseException], ...] = (UserError, FileNotFoundError)


def setup_logging() -> None:
    """Console logging for a stage process (called from `main`, never at import), without the third-party lines and
    warnings that `pipeline.core.third_party_output` names."""
    from pipeline.core.third_party_output import quiet_third_party_output

    logging.basicConfig(level=os.environ.get("LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet_third_party_output()


def what_it_does() -> str:
    """The first line of the running stage module's docstring (`python -m stages.<name>`), for the progress line."""
    doc = getattr(sys.modules.get("__main__"), "__doc__", None) or ""
    first = doc.strip().splitlines()[0] if doc.strip() else ""
    return first.split(": ", 1)[-1] if first.startswith("DVC stage") else first


def run_stage(*, name: str, body: Callable[[], None], run_id: str) -> None:
    """Run a stage body between two progress lines (what it does; how long it took, or how it failed), its time
    logged under pipeline execution `run_id`; a user error (`USER_FAILURES`) ends the process with exit 2 and one
    clear line. SIGTERM stops the body as Ctrl-C does (`sigterm_stops_the_body`)."""
    setup_logging()
    log = logging.getLogger("pipeline.stage")
    started = time.perf_counter()
    log.info("==> %s: %s", name, what_it_does() or "started")
    outcome = "failed"
    try:
        with sigterm_stops_the_body():
            body()
        outcome = "done"
    except USER_FAILURES as exc:
        print(f"error: stage '{name}' failed: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except SystemExit as exc:  # e.g. a preempted training job: exit 128 + signal, checkpoint written
        # status 0 (or none) is a body that ended the process successfully, as a launcher passing on its workers'
        # status does: done, like a body that returns
        outcome = "done" if exc.code in (0, None) else f"stopped (exit {exc.code})"
        raise
    finally:
        seconds = time.perf_counter() - started
        log.info("<== %s %s in %.1f s", name, outcome, seconds)
        record_stage_time(name, outcome=outcome, seconds=seconds, run_id=run_id)


#: The exit status of a process stopped by SIGTERM, as a shell reports one it killed (128 + the signal's number).
SIGTERM_STATUS = 128 + int(signal.SIGTERM)


class _ExitOnSigterm:
    """The handler: the first SIGTERM raises `SystemExit(SIGTERM_STATUS)`; any later one ends the process at once
    with SIGTERM's default action. It remembers that it fired, rather than only resetting the handler, because code
    that saved it while the body ran (Lightning's signal connector, training's `ResumableTraining`) puts it back
    during the cleanup."""

    def __init__(self) -> None:
        self.fired = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if self.fired:
            os.kill(os.getpid(), signal.SIGTERM)  # the default action now: the process ends here
        self.fired = True
        raise SystemExit(SIGTERM_STATUS)


@contextlib.contextmanager
def sigterm_stops_the_body() -> Iterator[None]:
    """SIGTERM (what `kill`, a scheduler's preemption, `docker stop` or a CI timeout send first) raises
    `SystemExit(143)` in the stage, as Ctrl-C raises `KeyboardInterrupt`: the stage's `finally` blocks and context
    managers run, so its MLflow run ends KILLED (`pipeline.core.tracking.stage_run`), a registered version whose
    packaging did not finish is deleted (`StageRun.registering`) and temporary files are removed, instead of the
    process vanishing with all of that left to the next stage. The outputs are safe either way: they are written to
    a temporary name and renamed into place (`pipeline.core.io`). Installed only where SIGTERM still has its
    default action, on the main thread; a handler set inside the body (training's checkpoint-then-stop,
    `pipeline.training.resume`) takes over while it is set; a torchrun launcher passes it on to its agent
    (`pipeline.training.elastic.launch`). A second SIGTERM, during the cleanup, ends the process at once. Python
    runs the handler between bytecodes, so a stage inside a long native call (an ONNX Runtime run, an OpenVINO
    compile) stops when that call returns."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
        yield
        return
    signal.signal(signal.SIGTERM, _ExitOnSigterm())
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


#: Where each stage process appends its wall time (`make run`'s summary reads it); a log, not a DVC output.
STAGE_LOG_ENV = "PIPELINE_STAGE_LOG"
STAGE_LOG = "logs/stages.jsonl"


def record_stage_time(name: str, *, outcome: str, seconds: float, run_id: str) -> None:
    """Append one line (pipeline run id, stage, outcome, seconds) to `$PIPELINE_STAGE_LOG` or `logs/stages.jsonl`;
    a log that cannot be written costs the summary a row, never the stage."""
    import json

    path = os.environ.get(STAGE_LOG_ENV, STAGE_LOG)
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"run_id": run_id, "stage": name, "outcome": outcome,
                                "seconds": round(seconds, 1), "at": time.time()}) + "\n")
    except OSError as exc:
        logging.getLogger("pipeline.stage").warning("stage time not logged to %s: %s", path, exc)


@dataclass(frozen=True)
class StageContext:
    """What every stage body receives: the validated params (as the file says them, `auto` kept), what each
    `auto` setting resolved to on this machine, the pipeline execution the stage belongs to (`run_id`,
    `pipeline.core.run_id`) and the arguments the stage was started with (`argv`, without the program: what a
    process that runs this stage again, a torchrun worker, is given), all decided once when the stage starts and
    passed down from here."""

    params: Params
    auto: ResolvedAuto
    run_id: str
    argv: tuple[str, ...] = ()

    @cached_property
    def run_context(self) -> RunContext:
        """The execution's MLflow context (store, experiment, parent run; `pipeline.core.parent_run.start_tracking`),
        looked up on first use and kept: one lookup per stage process, and none in one that logs nothing (a
        torchrun launcher, a training worker of rank > 0), so those never touch the store."""
        from pipeline.core.parent_run import start_tracking

        return start_tracking(self.params.mlflow, run_id=self.run_id)

    @classmethod
    def load(cls, name: str, params_file: Path, *, run_id: str, argv: Sequence[str] = ()) -> StageContext:
        """Load and validate `params_file`, resolve every `auto` once, and log the choices on one line (as stage
        `name`'s, of execution `run_id`, started with `argv`)."""
        from pipeline.core.params import load_params, resolve_auto

        params = load_params(params_file)
        auto = resolve_auto(params)
        logging.getLogger("pipeline.stage").info(
            "%s: auto settings on this machine: %s", name,
            "; ".join(f"{setting}={choice['value']}" for setting, choice in auto.choices().items()))
        return cls(params, auto, run_id, tuple(argv))


StageBody = Callable[..., None]


def stage_command(name: str, body: StageBody, doc: str | None = None, argv: Sequence[str] = ()) -> click.Command:
    """The typed command line of stage `name`: `--params FILE` plus one option per keyword parameter of `body`
    after its first (a `StageContext`), typed and documented by its annotation (`Annotated[Path,
    typer.Option(help=...)]`); running it reads the pipeline run id from the environment the stage was started
    with (`pipeline.core.run_id.pipeline_run_id`), loads the context (with `argv`, the arguments it parses) and
    runs `body` under `run_stage`."""
    import typer

    signature = inspect.signature(body, eval_str=True)
    context, *options = signature.parameters.values()
    if context.annotation is not StageContext:
        raise TypeError(f"stage {name}: the first parameter of {body.__name__} must be a StageContext")
    # the option every stage has: which params file to read (DVC's commands pass `params.yaml`)
    params_option = inspect.Parameter(
        "params_file", inspect.Parameter.KEYWORD_ONLY, default=Path("params.yaml"),
        annotation=Annotated[Path, typer.Option("--params", help="the params file (profiles compose over it)")])

    def command(params_file: Path, **values: Any) -> None:
        from pipeline.core.run_id import pipeline_run_id

        setup_logging()  # before the run id, whose fallback warns
        run_id = pipeline_run_id(os.environ)
        run_stage(name=name, run_id=run_id,
                  body=lambda: body(StageContext.load(name, params_file, run_id=run_id, argv=argv), **values))

    command.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[params_option, *(o.replace(kind=inspect.Parameter.KEYWORD_ONLY) for o in options)])
    command.__doc__ = doc
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command(name=name)(command)
    return typer.main.get_command(app)


def stage_main(name: str, body: StageBody, argv: list[str] | None = None) -> None:
    """Parse `argv` (default: the process's) with `stage_command` and run the stage; a usage error ends with exit
    status 2 and click's message, success returns (so `main([...])` can be called from Python)."""
    doc = getattr(sys.modules.get(body.__module__), "__doc__", None)
    if argv is None:  # the process's own command line: this stage is the process
        from pipeline.core.process_exit import skip_final_collection

        skip_final_collection()
        argv = sys.argv[1:]
    try:
        stage_command(name, body, doc, argv).main(args=list(argv), prog_name=f"python -m stages.{name}")
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise
