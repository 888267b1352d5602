"""Small file helpers shared by stages."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(path: Path, obj: Any) -> None:
    """Pretty, key-sorted JSON with parent folders created (stable diffs for DVC metrics)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def read_json(path: Path) -> Any:
    """JSON from a file, with the path in the error when it is missing or broken."""
    if not path.is_file():
        raise FileNotFoundError(f"expected JSON file not found: {path}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
