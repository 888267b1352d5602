"""What batch scoring (`pipeline.deployment.batch_scoring`) accepts, checked before Spark starts, so that a mistake
costs one line instead of a traceback after Spark's start, the model's load and a pass over the input, and no
data is destroyed or misread: the input (there, one format, UTF-8), the output (never the input or a folder of
the user's), the columns, the cores a task takes and the model. Each row's text is checked on Spark's executors
(`batch_rows`)."""

from __future__ import annotations

import bz2
import gzip
import lzma
import os
import re
import tempfile
from pathlib import Path

from pipeline.deployment.csv_text import check_csv_text

#: The input formats by file suffix; a compression suffix after it (`.csv.gz`) counts as the format's, as Spark
#: reads it.
FORMAT_OF_SUFFIX = {".csv": "csv", ".parquet": "parquet", ".pq": "parquet"}
COMPRESSION_SUFFIXES = (".gz", ".bz2", ".deflate", ".lz4", ".zst", ".snappy", ".xz")
#: How Python reads the compressed files Spark reads, for the checks of `check_input`.
DECOMPRESSORS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
#: What Spark leaves in an output folder besides its part files: a job's staging, as a killed job leaves it.
SPARK_WORK_DIRS = ("_temporary", ".spark-staging-")
#: What Hadoop's path globbing (which Spark applies to every path it reads) takes as a pattern; `\\` escapes.
GLOB_CHARACTERS = "[]{}*?\\"
#: The master URLs Spark starts on (`SparkSubmit`'s prefixes, `SparkContext`'s forms of local mode).
MASTER_URL = re.compile(r"local(\[(\*|\d+)(,\s*\d+)?\])?|local-cluster\[\d+,\s*\d+,\s*\d+\]|yarn|"
                        r"(spark|mesos|k8s)://\S+")
#: The output's columns beside the id.
OUTPUT_COLUMNS = ("label", "score", "error")


def has_glob(path: str) -> bool:
    """True when `path` holds a character Hadoop's globbing reads as a pattern (`GLOB_CHARACTERS`): Spark expands
    every path it reads, so such a path may name other files than the one spelled (`rev[1].parquet` reads
    `rev1.parquet`)."""
    return any(ch in path for ch in GLOB_CHARACTERS)


def literal_path(path: str, *, local_master: bool = True) -> Path | None:
    """The local file `path` spells, glob characters read as themselves (a plain path, or a `file:` URI taken as
    Hadoop takes it: no unquoting); None for another file system (`s3a://`, `hdfs://`) and, on a cluster
    (`local_master` False), for a plain path, which names the cluster's default file system."""
    if path.startswith("file:"):
        rest = path.removeprefix("file:")
        if rest.startswith("//"):  # `file:///d/x`, or `file://host/d/x` with an authority
            rest = rest[2:] if rest[2:].startswith("/") else "/" + rest[2:].partition("/")[2]
        return Path(rest)
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", path) or not local_master:
        return None
    return Path(path)


def local_path(path: str, *, local_master: bool = True) -> Path | None:
    """The local file `path` names (`literal_path`), None where the checks cannot look: another file system, a
    cluster's plain path, and a glob (`reviews/*.csv`, which Spark expands itself)."""
    return None if has_glob(path) else literal_path(path, local_master=local_master)


def hadoop_literal(path: str) -> str:
    """`path` escaped for Hadoop's globbing (a backslash before each of `GLOB_CHARACTERS`), so that Spark reads the
    file of that very name: one of a folder's files, listed here, named `rev[1].parquet`."""
    return re.sub(r"([\\\[\]{}*?])", r"\\\1", path)


def format_of(file: Path) -> str | None:
    """"csv" or "parquet" by the file's suffix, a compression suffix after it allowed (`a.csv.gz`); None otherwise."""
    suffixes = [s.lower() for s in file.suffixes]
    while suffixes and suffixes[-1] in COMPRESSION_SUFFIXES:
        suffixes.pop()
    return FORMAT_OF_SUFFIX.get(suffixes[-1]) if suffixes else None


def read_files(folder: Path) -> list[Path]:
    """The files directly in `folder` that Spark reads: not in subfolders, not hidden (`.name`) and not its own
    bookkeeping (`_SUCCESS`, `_committed_*`)."""
    return sorted(f for f in folder.iterdir() if f.is_file() and not f.name.startswith(("_", ".")))


def skipped_names(folder: Path) -> str:
    """A note naming the data files of `folder` Spark skips for their names (`_x.parquet`, `.x.csv`), or ""."""
    hidden = sorted(f.name for f in folder.iterdir() if f.is_file() and f.name.startswith(("_", ".")) and format_of(f))
    if not hidden:
        return ""
    return f"; Spark skips a file whose name begins with _ or ., as {', '.join(hidden[:3])}: rename it"


def files_to_read(folder: Path, fmt: str) -> list[Path] | None:
    """The files of `folder` Spark is given for format `fmt`: those named as that format (a README beside them is
    not read as data), or None (the folder as it is) where no file is so named (Hive's suffix-less part files, or
    Parquet's `key=value` subfolders)."""
    named = [f for f in read_files(folder) if format_of(f) == fmt]
    return named or None


def input_format(path: str, fmt: str = "auto", *, local_master: bool = True) -> str:
    """"parquet" or "csv": `fmt` when given, else by the name (`.csv`, `.parquet`/`.pq`, compressed or not), and
    for a local folder by the files directly in it (`read_files`), or else by the first file in its `key=value`
    subfolders (a partitioned dataset). A folder of both formats, or of neither, is a `ValueError`: Spark would read
    every file as one format."""
    if fmt != "auto":
        return fmt
    named = format_of(Path(path.rstrip("/")))
    if named is not None:
        return named
    folder = local_path(path, local_master=local_master)
    if folder is None or not folder.is_dir():
        return "parquet"
    files = read_files(folder)
    kinds = {kind for f in files if (kind := format_of(f))}
    if len(kinds) > 1:
        raise ValueError(f"{path} holds both CSV and Parquet files: pass --format to read one kind (the other is "
                         "skipped), or give each its own folder")
    if kinds:
        return kinds.pop()
    partitions = [d for d in folder.iterdir() if d.is_dir() and "=" in d.name]
    if files or not partitions:
        raise ValueError(f"{path} holds no .csv or .parquet file directly in it (Spark reads a folder's own files, "
                         "not its subfolders', except key=value subfolders): pass --format, or name the files"
                         + skipped_names(folder))
    below = (kind for d in partitions for f in sorted(d.rglob("*")) if f.is_file() and (kind := format_of(f)))
    return next(below, "parquet")


def check_input(path: str, fmt: str, *, local_master: bool = True) -> None:
    """Refuse, before Spark starts, a local input that Spark would read wrongly or fail on late: a path that is not
    there, a file of the other format (Parquet files begin with `PAR1`), and a CSV file Spark would misread silently
    (`csv_text.check_csv_text`: not UTF-8, or a quoted field that never closes). Inputs the checks cannot look at
    (`local_path`) are Spark's to check; a compressed file is checked after decompression where Python reads the
    codec (gzip, bzip2, xz), else left to Spark."""
    literal = literal_path(path, local_master=local_master)
    if has_glob(path) and literal is not None and (literal.exists() or literal.is_symlink()):
        raise ValueError(f"{path} exists, but its name holds a glob character ({' '.join(GLOB_CHARACTERS)}), which "
                         "Spark reads as a pattern that may match other files (rev[1].parquet matches rev1.parquet): "
                         "rename it without them, or pass the folder it is in")
    local = local_path(path, local_master=local_master)
    if local is None:
        return
    if not local.exists():
        raise ValueError(f"{path} does not exist")
    if local.is_file() and local.name.startswith(("_", ".")):
        raise ValueError(f"{path}: Spark skips a file whose name begins with _ or . (its own bookkeeping, hidden "
                         "files), and would find nothing to read: rename it")
    files = (files_to_read(local, fmt) or read_files(local)) if local.is_dir() else [local]
    if local.is_dir() and not files and not any(d.is_dir() and "=" in d.name for d in local.iterdir()):
        raise ValueError(f"{path} holds no file Spark reads" + skipped_names(local))
    if fmt == "csv" and files and all(f.stat().st_size == 0 for f in files):
        # Spark would start, read no header and report a text column among no columns
        empty = files[0] if len(files) == 1 else f"every CSV file of {path}"
        raise ValueError(f"{empty} is empty (0 bytes): a CSV input needs a header row naming its text column, "
                         "then a row per review")
    for file in files:
        opener = DECOMPRESSORS.get(file.suffix.lower())
        if opener is None and file.suffix.lower() in COMPRESSION_SUFFIXES:
            continue
        if fmt == "parquet" and file.stat().st_size == 0:
            raise ValueError(f"{file} is empty (0 bytes), not a Parquet file: write it again, or remove it")
        with (opener or open)(file, "rb") as f:
            parquet = f.read(4) == b"PAR1"
        if parquet != (fmt == "parquet"):
            raise ValueError(f"{file} is {'a Parquet' if parquet else 'not a Parquet'} file, but is read as {fmt}: "
                             "pass --format " + ("parquet" if parquet else "csv"))
        if fmt == "csv":
            check_csv_text(file, opener=opener)
        elif opener is None:
            check_parquet_footer(file)


def check_parquet_footer(file: Path) -> None:
    """`ValueError` for a Parquet file cut short (a copy or a write that did not finish): it must end with its
    footer's length and `PAR1`, and the footer must fit in the file. Spark's own error names no file."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        f.seek(max(0, size - 8))
        tail = f.read(8)
    footer = int.from_bytes(tail[:4], "little")
    if size < 12 or tail[4:] != b"PAR1" or footer > size - 12:
        raise ValueError(f"{file} is not a whole Parquet file (its footer does not fit its {size} bytes): it was cut "
                         "short (a copy or a write that did not finish?); write it again")


def check_paths(input_path: str, output_path: str, *, fmt: str, overwrite: bool, local_master: bool) -> str:
    """The input's format (`input_format`) once the output (`check_output`) and the input (`check_input`) passed."""
    check_output(input_path, output_path, overwrite, local_master=local_master)
    fmt = input_format(input_path, fmt, local_master=local_master)
    check_input(input_path, fmt, local_master=local_master)
    return fmt


def check_output(input_path: str, output_path: str, overwrite: bool, *, local_master: bool = True) -> None:
    """Refuse, before Spark starts, an output that would destroy data or fail late: the input itself, a folder
    holding the input or inside an input folder, an output that exists without `overwrite`, and, with it, anything
    but an earlier output of Spark's (a folder with `_SUCCESS`, or only part files, Spark's bookkeeping and a killed
    job's staging): Spark's overwrite deletes whatever is there first. An output holding a glob character is refused
    whatever its file system: Spark reads it back (`spark_io.count_output`) as a pattern, which may match another
    folder. Local paths are compared as files (the same folder by another name, a symlink or a bind mount is the
    same); paths the checks cannot look at by name."""
    if has_glob(output_path):
        raise ValueError(f"the output {output_path} holds a glob character ({' '.join(GLOB_CHARACTERS)}): Spark would "
                         "read it back as a pattern, which may name another folder: name it without them")
    out, inp = local_path(output_path, local_master=local_master), local_path(input_path, local_master=local_master)
    if out is None or inp is None:
        a, b = (_uri_path(p) + "/" for p in (output_path, input_path))
        overlaps = a.startswith(b) or b.startswith(a)
    else:
        overlaps = _holds(out, inp) or (inp.is_dir() and _holds(inp, out))
    if overlaps:
        raise ValueError(f"the output {output_path} is the input, holds it or lies inside it: write the answers "
                         "elsewhere (Spark's overwrite deletes the output before it writes)")
    if out is not None:
        check_writable(out, output_path)
    if out is None or inp is None:
        return
    if not out.exists() and not out.is_symlink():
        return
    if not overwrite:
        raise ValueError(f"{output_path} exists: pass --overwrite to replace it (an earlier output of this command)")
    if out.is_symlink() or not out.is_dir():
        raise ValueError(f"{output_path} is not a folder Spark wrote: refusing to replace it with --overwrite")
    foreign = [e.name for e in out.iterdir() if not e.name.startswith(SPARK_WORK_DIRS)
               and not (e.is_file() and e.name.startswith(("part-", "_", ".")))]
    if foreign and not (out / "_SUCCESS").is_file():
        raise ValueError(f"{output_path} holds {', '.join(sorted(foreign)[:3])}{' ...' if len(foreign) > 3 else ''}, "
                         "which Spark did not write: refusing to delete it with --overwrite")


def check_writable(out: Path, output_path: str) -> None:
    """`ValueError` where the local output cannot be created (Spark would fail only after the model's load and a
    pass over the input): under a file, or in a folder where no new folder can be made (read-only, `/proc`), tried
    where the staging folder goes (`batch_output`: beside the output), in its nearest folder that exists."""
    parent = Path(os.path.abspath(out)).parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"the output {output_path} cannot be created: {parent} is a file, not a folder")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".scoring-probe-", dir=parent))
    except OSError as exc:
        raise ValueError(f"the output {output_path} cannot be written: no folder can be made in {parent} "
                         f"({exc.strerror})") from None


def _holds(folder: Path, path: Path) -> bool:
    """True when `path` is `folder` or lies inside it, by name once resolved or as the same file (`samefile`: another
    spelling on a case-insensitive file system, a bind mount)."""
    folder, path = folder.resolve(), path.resolve()
    if folder == path or folder in path.parents:
        return True
    if not folder.exists():
        return False
    return any(p.exists() and os.path.samefile(p, folder) for p in (path, *path.parents))


def _uri_path(uri: str) -> str:
    """`uri` for comparing by name: no trailing slash, no doubled slashes after the scheme's."""
    scheme, sep, rest = uri.partition("://")
    rest = re.sub(r"/{2,}", "/", rest if sep else scheme).rstrip("/")
    return f"{scheme}://{rest}" if sep else rest


def check_columns(id_column: str | None, text_column: str) -> None:
    """`ValueError` for an id column named like an answer's column, ignoring case as Spark does (the output would
    hold two)."""
    if id_column is not None and id_column.lower() in OUTPUT_COLUMNS:
        raise ValueError(f"--id-column {id_column!r} is the name of an output column ({', '.join(OUTPUT_COLUMNS)}): "
                         "rename it in the input")
    if not text_column:
        raise ValueError("--text-column is empty")


def check_master(master: str) -> None:
    """`ValueError` for a master URL Spark does not know (its start would fail with a Java trace and a Python one)."""
    if MASTER_URL.fullmatch(master.strip()) is None:
        raise ValueError(f"--master {master!r} is not a master URL Spark knows: local, local[N], local[*], yarn, "
                         "spark://host:port, k8s://https://host:port or mesos://host:port")


def check_task_threads(master: str, task_threads: int) -> None:
    """`ValueError` when a local master has fewer cores than one task takes (Spark would fail at start-up)."""
    match = re.fullmatch(r"local(?:\[(\*|\d+)(?:,\s*\d+)?\])?", master.strip())
    if match is None:
        return  # a cluster: its executors' cores are its own
    from pipeline.core.machine import available_cpus

    cores = 1 if match[1] is None else available_cpus() if match[1] == "*" else int(match[1])  # "local": one core
    if task_threads > cores:
        raise ValueError(f"--task-threads {task_threads} is more than the {cores} core(s) of --master {master}")


def check_model(model_uri: str, champion: str, store: str) -> None:
    """Exit with one line, before Spark starts, when the model cannot be found: the champion not registered yet
    (run `make run`), or a `--model-uri` that MLflow cannot resolve, instead of MLflow's traceback from inside
    `spark_udf`."""
    from pipeline.core.model_registry import StoreError, check_model_uri, registered_version, store_errors

    try:
        if model_uri == champion:
            with store_errors():
                registered_version(*champion.removeprefix("models:/").split("@"), tracking_uri=store)
        else:
            check_model_uri(model_uri)
    except LookupError as exc:
        raise SystemExit(f"{exc}: run `make run` first (its package stage registers the champion) or pass "
                         "--model-uri") from None
    except (StoreError, OSError) as exc:
        raise SystemExit(f"the model {model_uri} cannot be read (tracking store {store}): {exc}") from None
