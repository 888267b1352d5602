"""Reading and editing params files as text: YAML 1.2 as DVC reads and writes them, and in-place edits of single
keys that keep the file's comments (`python -m pipeline.core.params set`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError

from pipeline.core.settings.validation import ParamsError


def load_yaml(text: str) -> Any:
    """YAML 1.2, as DVC reads and writes params files (1.1 readers take `5e-05` for a string)."""
    return YAML(typ="safe", pure=True).load(text)


def read_params(path: str | Path) -> dict[str, Any]:
    """Read the whole params file once; the caller picks sections with `section`."""
    p = Path(path)
    if not p.is_file():
        raise ParamsError(f"params file not found: {p}")
    try:
        raw = load_yaml(p.read_text()) or {}
    except YAMLError as exc:
        raise ParamsError(f"{p} is not valid YAML: {' '.join(str(exc).split())}") from None
    if not isinstance(raw, dict):
        raise ParamsError(f"{p} must hold a mapping of sections")
    return raw


def set_value(path: str | Path, dotted_key: str, value: str) -> None:
    """Set one existing key of the params file in place to `value` (YAML text), keeping comments."""
    rt = YAML()
    rt.representer.add_representer(  # keep `null` spelled out instead of an empty value
        type(None), lambda r, _: r.represent_scalar("tag:yaml.org,2002:null", "null"))
    p = Path(path)
    doc = rt.load(p.read_text())
    node = doc
    *parents, leaf = dotted_key.split(".")
    for part in parents:
        node = node.get(part) if hasattr(node, "get") else None
        if node is None:
            break
    if not hasattr(node, "get") or leaf not in node:
        raise ParamsError(f"unknown key {dotted_key} in {p}")
    node[leaf] = load_yaml(value)
    with p.open("w") as fh:
        rt.dump(doc, fh)
