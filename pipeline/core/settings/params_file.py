"""Reading and editing params files as text: YAML 1.2 as DVC reads and writes them, and in-place edits of single
keys that keep the file's comments (`python -m pipeline.core.params set`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError

from pipeline.core.settings.validation import ParamsError


def load_yaml(text: str) -> Any:
    """YAML 1.2, as DVC reads and writes params files (1.1 readers take `5e-05` for a string)."""
    return YAML(typ="safe", pure=True).load(text)


def one_line(exc: YAMLError) -> str:
    """A YAML parser's error, its lines (the marked snippet included) joined into one for a one-line message."""
    return " ".join(str(exc).split())


def read_params(path: str | Path) -> dict[str, Any]:
    """Read the whole params file once; the caller picks sections with `section`."""
    p = Path(path)
    if not p.is_file():
        raise ParamsError(f"params file not found: {p}")
    try:
        raw = load_yaml(p.read_text()) or {}
    except YAMLError as exc:
        raise ParamsError(f"{p} is not valid YAML: {one_line(exc)}") from None
    if not isinstance(raw, dict):
        raise ParamsError(f"{p} must hold a mapping of sections")
    return raw


def set_value(path: str | Path, dotted_key: str, value: str) -> None:
    """Set one existing key of the params file in place to `value` (YAML text), keeping comments (`set_values`)."""
    set_values(path, [(dotted_key, value)])


def set_values(path: str | Path, assignments: Sequence[tuple[str, str]],
               check: Callable[[Path], object] | None = None) -> None:
    """Set existing keys of the params file to values (YAML text), keeping comments: all or none. They are applied
    to the document in memory, written beside the file, `check`ed there (the whole params' validation: a rule across
    keys may need all of them) and renamed onto it only then, so a bad value, a refused check or a kill mid-write
    leaves the file as it was."""
    from pipeline.core.io import replaced_on_success

    rt = YAML()
    rt.representer.add_representer(  # keep `null` spelled out instead of an empty value
        type(None), lambda r, _: r.represent_scalar("tag:yaml.org,2002:null", "null"))
    p = Path(path)
    try:
        doc = rt.load(p.read_text())
    except YAMLError as exc:
        raise ParamsError(f"{p} is not valid YAML: {one_line(exc)}") from None
    for dotted_key, value in assignments:
        node = doc
        *parents, leaf = dotted_key.split(".")
        for part in parents:
            node = node.get(part) if hasattr(node, "get") else None
            if node is None:
                break
        if not hasattr(node, "get") or leaf not in node:
            raise ParamsError(f"unknown key {dotted_key} in {p}")
        try:
            node[leaf] = load_yaml(value)
        except YAMLError as exc:
            raise ParamsError(f"{dotted_key}: {value!r} is not a YAML value: {one_line(exc)}") from None
    with replaced_on_success(p) as tmp:
        with tmp.open("w") as fh:
            rt.dump(doc, fh)
        if check is not None:
            check(tmp)
