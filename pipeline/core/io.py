"""Small file helpers shared by stages: files and model directories are written whole or not at all
(`replaced_on_success`, `directory_replaced_on_success`)."""

from __future__ import annotations

import contextlib
import functools
import glob
import hashlib
import json
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from pipeline.core import process_identity


def synced(path: Path) -> None:
    """`fsync` a file, or a directory's entries (where the filesystem allows it): a rename is durable only once the
    renamed file's data and then its folder are on disk, else a crash of the machine (not only of the process) can
    leave the new name on an empty or partial file after the old one was deleted."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # a directory on a filesystem that does not sync them (EINVAL): nothing more to do
        pass
    finally:
        os.close(fd)


@functools.cache
def _writers_context() -> str:
    """Where this process's ids mean something, as a short digest fit for a file name: its host, boot, machine and
    pid namespace (`process_identity.current()` without the process's own id and start time)."""
    here = process_identity.current()
    context = {k: v for k, v in here.items() if k not in (process_identity.PID_TAG, process_identity.STARTED_TAG)}
    return hashlib.sha256(json.dumps(context, sort_keys=True).encode()).hexdigest()[:12]


def writer_tag() -> str:
    """This process as a temporary file names its writer: `<pid>@<context>` (`_writers_context`), so a folder
    shared between machines or containers (a checkpoint directory on network storage) tells whose process ids
    its temporary files carry."""
    return f"{os.getpid()}@{_writers_context()}"


def remove_dead_writers_files(path: Path) -> None:
    """Remove the temporary files of `path` (`.<name>.<writer_tag>.tmp`) whose writer has certainly ended
    (`process_identity.has_ended`: the same host, boot and pid namespace as this process, and no process with that
    id): a process killed mid-write leaves one, which nothing trusts but a folder upload (MLflow artifacts) would
    carry along. Another context's, and any name that is no such file, are left alone; a file or folder that
    cannot be read never fails the write."""
    context, here = _writers_context(), None
    try:
        strays = list(path.parent.glob(f".{glob.escape(path.name)}.*@*.tmp"))
    except OSError:
        return
    for tmp in strays:
        pid, _, writer = tmp.name[len(path.name) + 2 : -len(".tmp")].partition("@")
        if writer != context or not (pid.isascii() and pid.isdigit()) or int(pid) == os.getpid():
            continue
        here = here or process_identity.current()
        tags = {k: v for k, v in here.items() if k != process_identity.STARTED_TAG} | {process_identity.PID_TAG: pid}
        try:
            if process_identity.has_ended(tags, here):
                tmp.unlink(missing_ok=True)
        except (OSError, OverflowError):  # an id too large to signal: no process of this system
            continue


@contextlib.contextmanager
def replaced_on_success(path: Path) -> Iterator[Path]:
    """A temporary path beside `path` (same folder, so the rename is atomic) for the block to write; synced and
    renamed onto `path` when the block ends without error, removed when it raises. A reader (a later stage, a
    server, a resumed run) finds the old file, the whole new one or none: never a part of one, whenever the writer
    (or the machine) dies. Temporary files of killed writers of `path` are removed first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_writers_files(path)
    tmp = path.with_name(f".{path.name}.{writer_tag()}.tmp")
    try:
        yield tmp
        if tmp.is_file():
            synced(tmp)
        os.replace(tmp, path)
        synced(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


#: Name parts of a directory's hidden siblings: `.<name>.building-<pid>` holds a build in progress,
#: `.<name>.replaced-<pid>` the previous version for the instant it is swapped out.
BUILDING = "building"
REPLACED = "replaced"


class IncompleteDirectory(RuntimeError):
    """A directory build ended without writing the file that marks it complete."""


def stale_builds(final_dir: Path) -> list[Path]:
    """Hidden siblings of `final_dir` left by a build of it that was killed (`directory_replaced_on_success`)."""
    parent = final_dir.parent
    if not parent.is_dir():
        return []
    return sorted(p for kind in (BUILDING, REPLACED) for p in parent.glob(f".{final_dir.name}.{kind}-*"))


@contextlib.contextmanager
def directory_replaced_on_success(final_dir: Path, complete_when: str) -> Iterator[Path]:
    """A fresh directory for the block to build `final_dir` in, which replaces `final_dir` whole when the block ends
    without error and has written `complete_when` (the directory's record, written last); removed, with `final_dir`
    left as it was, when the block raises or wrote no record (`IncompleteDirectory`).

    The directory is a hidden sibling of `final_dir` (`.<name>.building-<pid>`), on the same filesystem so the
    swap is a rename and intermediate files can be renamed into it; leftovers of a killed build of the same
    directory are removed first (`stale_builds`). Builds of one directory are not run concurrently (DVC locks the
    repository for a `repro`): a second one would remove the first's directory and make it fail, never publish
    a mix.

    The swap is two renames: the old directory aside (`.<name>.replaced-<pid>`), then the new one into place,
    then the old one removed. Between the two renames `final_dir` does not exist, so a reader then finds nothing,
    never a record beside files it does not describe; a build stopped there by an exception (Ctrl-C, SIGTERM)
    puts the old one back, and a process killed outright leaves both hidden directories for the next build to
    remove. Removing the old directory instead of renaming it aside would widen that window to
    a whole `rmtree`, and a kill during it would leave part of the old version in place."""
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    for stale in stale_builds(final_dir):
        shutil.rmtree(stale, ignore_errors=True)
    work = final_dir.with_name(f".{final_dir.name}.{BUILDING}-{os.getpid()}")
    old = final_dir.with_name(f".{final_dir.name}.{REPLACED}-{os.getpid()}")
    work.mkdir()
    try:
        yield work
        if not (work / complete_when).is_file():
            raise IncompleteDirectory(f"the build of {final_dir} wrote no {complete_when}")
        for part in sorted(work.rglob("*"), reverse=True):  # files before the folders that list them
            if part.is_file() or part.is_dir():  # not a FIFO or socket, which an open would wait on
                synced(part)
        synced(work)
        if os.path.lexists(final_dir):
            os.replace(final_dir, old)
        os.replace(work, final_dir)
        synced(final_dir.parent)
    finally:
        if os.path.lexists(old) and not os.path.lexists(final_dir):
            # the swap stopped halfway (a failed rename, Ctrl-C or SIGTERM between the two): the previous version
            # goes back rather than none
            os.replace(old, final_dir)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def write_json(path: Path, obj: Any) -> None:
    """Pretty, key-sorted JSON with parent folders created (stable diffs for DVC metrics), written whole."""
    with replaced_on_success(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def save_figure(fig: Any, path: Path) -> None:
    """A matplotlib figure saved to `path` whole (`replaced_on_success`), in the format its suffix names."""
    with replaced_on_success(path) as tmp:
        fig.savefig(tmp, format=path.suffix.lstrip(".") or None)


def read_json(path: Path) -> Any:
    """JSON from a file, with the path in the error when it is missing or broken."""
    if not path.is_file():
        raise FileNotFoundError(f"expected JSON file not found: {path}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc


def token_fingerprint(seqs: Any) -> str:
    """SHA-256 over a split's token ids in order: ties saved predictions to the exact reviews they score."""
    import numpy as np

    digest = hashlib.sha256()
    for ids in seqs:
        arr = np.asarray(ids, dtype=np.int32)
        digest.update(len(arr).to_bytes(4, "little"))
        digest.update(arr.tobytes())
    return digest.hexdigest()


def digest_paths(paths: Sequence[Path]) -> str:
    """SHA-256 over the files under `paths` (names relative to each path, then contents), caches skipped."""
    h = hashlib.sha256()
    for root in paths:
        if not root.exists():  # the job's own loading reports a missing input; here it is just part of the digest
            h.update(f"<missing {root.name}>".encode())
            continue
        files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
        for f in files:
            if "__pycache__" in f.parts or f.suffix == ".pyc":
                continue
            h.update(str(f.relative_to(root) if root.is_dir() else f.name).encode() + b"\0")
            with f.open("rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()


def write_predictions(path: Path, logits: Any, labels: Any, seqs: Any, **meta: Any) -> None:
    """Logits, labels and the split's fingerprint in one `.npz`, so a later stage can reuse a scoring pass."""
    import numpy as np

    with replaced_on_success(path) as tmp, tmp.open("wb") as fh:
        np.savez(fh, logits=np.asarray(logits, dtype=np.float32), labels=np.asarray(labels),
                 fingerprint=np.array(token_fingerprint(seqs)), meta=np.array(json.dumps(meta, sort_keys=True)))


def read_predictions(path: Path, seqs: Any, labels: Any) -> tuple[Any, dict[str, Any]]:
    """Logits saved by `write_predictions`, refused unless they score exactly these reviews and labels."""
    import numpy as np

    if not path.is_file():
        raise FileNotFoundError(f"saved predictions not found: {path} (run `dvc repro finetune`)")
    with np.load(path) as data:
        logits, saved_labels = data["logits"], data["labels"]
        fingerprint, meta = str(data["fingerprint"]), json.loads(str(data["meta"]))
    if fingerprint != token_fingerprint(seqs) or not np.array_equal(saved_labels, np.asarray(labels)):
        raise ValueError(f"{path} scores a different test split than the one given (stale predictions: "
                         "rerun `dvc repro finetune`)")
    if logits.shape != (len(seqs), 2):
        raise ValueError(f"{path}: logits of shape {logits.shape}, expected ({len(seqs)}, 2)")
    return logits, meta
