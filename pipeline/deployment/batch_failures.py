"""How a batch-scoring run (`pipeline.deployment.batch_scoring`) ends when it does not finish: SIGINT or SIGTERM
cancels Spark's jobs and ends the command with one line and the shell's status for the signal (130, 143), leaving
no half-written output (`batch_output`); an error of Spark's that nothing recognised is one line, its first
meaningful one, with the full traceback in a log file (`spark_error_exit`), exit status 1."""

from __future__ import annotations

import os
import re
import signal
import sys
import tempfile
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

#: The signals that stop a run; each exits with 128 + its number, as a shell reports a process it ended.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
#: Seconds between two cancellations of Spark's jobs once a stop signal came: a job that starts after one (the next
#: step of the run) is cancelled in turn.
CANCEL_EVERY_S = 0.5


class Interrupted(BaseException):
    """A stop signal ended the run. A `BaseException`, as `KeyboardInterrupt`, so that no `except Exception` on the
    way takes it for an error of the step it interrupted."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopOnSignals:
    """SIGINT and SIGTERM handled for one run (`install` them in the main thread; `restore` puts back what was there).

    On the first signal every Spark job is cancelled, from a thread of its own and again every `CANCEL_EVERY_S`
    (a Py4J call cannot be made from the main thread while it waits on one); the main thread raises `Interrupted`
    at once unless it is inside a Py4J call (breaking off a call would leave its connection with an answer still to
    read, which the next call would take for its own) or the signal is deferred (`deferred`): there the cancelled
    job's error, or `check`, ends the run. A second signal exits at once."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.raised = False
        self.deferring = False
        self._previous: dict[int, Any] = {}
        self._stop = threading.Event()
        self._canceller: threading.Thread | None = None

    def install(self) -> None:
        """Handle the stop signals here (again after SparkContext, which installs its own SIGINT handler, started)."""
        for signum in STOP_SIGNALS:
            previous = signal.signal(signum, self._handle)
            self._previous.setdefault(signum, previous)

    def restore(self) -> None:
        """Put back the handlers from before `install`, and stop cancelling Spark's jobs."""
        for signum, previous in self._previous.items():  # None: a handler installed outside Python
            signal.signal(signum, signal.SIG_DFL if previous is None else previous)
        self._previous.clear()
        self._stop.set()
        if self._canceller is not None:
            self._canceller.join(timeout=5)

    def check(self) -> None:
        """Raise `Interrupted` if a stop signal came and has not ended the run yet."""
        if self.received is not None and not self.raised:
            self.raised = True
            raise Interrupted(self.received)

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """A stop signal during the block does not break it off (a swap of folders that must not stop half-way): the
        block's own end decides (an error then is the interruption's; a block that ends well ends the run well)."""
        self.deferring = True
        try:
            yield
        finally:
            self.deferring = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:
            print(f"{signal.Signals(signum).name} again: exiting at once", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.received = signum
        self._canceller = threading.Thread(target=self._cancel_jobs, name="scoring-cancel", daemon=True)
        self._canceller.start()
        if not self.deferring and not in_py4j_call(frame):
            self.check()

    def _cancel_jobs(self) -> None:
        from pyspark import SparkContext

        quiet = False
        while not self._stop.is_set():
            context = SparkContext._active_spark_context
            if context is not None:
                try:
                    if not quiet:  # the cancelled jobs' errors and aborted writes are expected: not logged
                        context.setLogLevel("OFF")
                        quiet = True
                    context.cancelAllJobs()
                except Exception:  # the JVM is gone or going: nothing is left to cancel
                    pass
            self._stop.wait(CANCEL_EVERY_S)


def in_py4j_call(frame: FrameType | None) -> bool:
    """True when `frame` (the main thread's, where a signal is handled) is inside Py4J, waiting on the JVM."""
    while frame is not None:
        if f"{os.sep}py4j{os.sep}" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


#: The handlers of the run in progress (`stop_on_signals`), for `signals_deferred`.
_ACTIVE: list[StopOnSignals] = []


@contextmanager
def stop_on_signals() -> Iterator[StopOnSignals]:
    """SIGINT and SIGTERM stop the run for the block (`StopOnSignals`), from the main thread; elsewhere (a thread has
    no signal handlers) the block runs as it is."""
    stops = StopOnSignals()
    if threading.current_thread() is not threading.main_thread():
        yield stops
        return
    stops.install()
    _ACTIVE.append(stops)
    try:
        yield stops
    finally:
        _ACTIVE.remove(stops)
        stops.restore()


@contextmanager
def signals_deferred() -> Iterator[None]:
    """The block runs to its end before a stop signal ends the run (`StopOnSignals.deferred`); outside a run's
    `stop_on_signals` it just runs."""
    if not _ACTIVE:
        yield
        return
    with _ACTIVE[-1].deferred():
        yield


def interruption_point() -> None:
    """Raise `Interrupted` if a stop signal came during a step that went on to its end (a Py4J call)."""
    if _ACTIVE:
        _ACTIVE[-1].check()


#: Messages of Spark's that only wrap the error that matters (a task's, inside the job's; a thread's result): the
#: cause under them is reported instead.
WRAPPERS = ("Job aborted due to stage failure", "Exception thrown in awaitResult", "An error occurred while calling",
            "Task failed while writing rows", "[TASK_WRITE_FAILED]", "Multiple failures in stage materialization")
#: A Java exception's class before its message (`org.apache.spark.SparkException: ...`).
JAVA_CLASS = re.compile(r"^(?:[a-z_$][\w$]*\.)+([A-Z][\w$]*(?:Exception|Error))(?::\s*|$)")


def java_causes(exc: BaseException) -> list[str]:
    """The messages (`toString`) of the Java exception behind `exc` and of its causes, outermost first; empty for an
    error that did not come from the JVM, or where the JVM can no longer be asked."""
    from py4j.protocol import Py4JJavaError

    if not isinstance(exc, Py4JJavaError):
        return []
    causes: list[str] = []
    try:
        throwable = exc.java_exception
        while throwable is not None and len(causes) < 20:
            causes.append(str(throwable.toString()))
            throwable = throwable.getCause()
    except Exception:  # the JVM is gone: what was read so far
        pass
    return causes


def first_line(message: str) -> str:
    """The line of `message` that says what went wrong: a Python traceback's last line (a worker's error), else the
    first non-empty line, without the Java class before it (its short name where there is no message)."""
    lines = [line.strip() for line in message.splitlines() if line.strip() and not line.startswith("\tat ")]
    if "Traceback (most recent call last):" in message:
        python = [line for line in lines if not line.startswith(("at ", "File ", "^", "~"))]
        lines = python[-1:] or lines
    line = lines[0] if lines else message.strip()
    match = JAVA_CLASS.match(line)
    if match is not None:
        line = line[match.end():] or match[1]
    return line


def spark_error_line(exc: BaseException) -> str | None:
    """One line saying what an error of Spark's (Py4J's, PySpark's, the JVM's) was: the first message in its chain
    of causes that is not a wrapper (`WRAPPERS`); None for an error that is not Spark's."""
    from py4j.protocol import Py4JError
    from pyspark.errors import PySparkException

    if not isinstance(exc, (Py4JError, PySparkException)):
        return None
    for message in java_causes(exc):
        line = first_line(message)
        if not any(wrapper in line for wrapper in WRAPPERS):
            return line
    return first_line(str(exc))


def spark_error_exit(exc: BaseException) -> SystemExit | None:
    """For an error of Spark's that nothing recognised: one line on stderr, the full traceback in a log file it
    names, and exit status 1; None for an error that is not Spark's (a fault of this code's keeps its traceback)."""
    line = spark_error_line(exc)
    if line is None:
        return None
    fd, log = tempfile.mkstemp(prefix="batch-scoring-", suffix=".log")
    with os.fdopen(fd, "w") as f:
        f.write("".join(traceback.format_exception(exc)))
    print(f"error: Spark failed: {line} (the full traceback: {log}; Spark's own log lines are above)",
          file=sys.stderr)
    return SystemExit(1)
