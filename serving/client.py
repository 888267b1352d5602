"""Tiny client for the sentiment endpoint: `python -m serving.client "great movie" ["awful film" ...]`.

It reads the inference token from TorchServe's `key_file.json` (token authorization is on).
"""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any


def inference_key(key_file: Path) -> str | None:
    """The current inference key, or None when the file is absent (token auth disabled)."""
    if not key_file.is_file():
        return None
    return json.loads(key_file.read_text())["inference"]["key"]


def predict(texts: list[str], url: str = "http://127.0.0.1:8080", key: str | None = None,
            timeout: float = 30.0) -> tuple[int, Any]:
    """POST one text (`{"text"}`) or several (`{"texts"}`); returns (HTTP status, decoded JSON body)."""
    payload = {"text": texts[0]} if len(texts) == 1 else {"texts": texts}
    req = urllib.request.Request(f"{url}/predictions/sentiment", data=json.dumps(payload).encode("utf-8"),
                                 headers={"Content-Type": "application/json"}, method="POST")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as err:
        body = err.read()
        try:
            return err.code, json.loads(body)
        except json.JSONDecodeError:
            return err.code, body.decode("utf-8", "replace")


def main(argv: list[str] | None = None) -> None:
    """Print the endpoint's answer for the given reviews."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("texts", nargs="+")
    parser.add_argument("--url", default="http://127.0.0.1:8080")
    parser.add_argument("--key-file", type=Path, default=Path("key_file.json"))
    args = parser.parse_args(argv)
    status, body = predict(args.texts, args.url, inference_key(args.key_file))
    print(json.dumps(body, indent=2))
    if status != 200:
        raise SystemExit(f"HTTP {status}")


if __name__ == "__main__":
    main()
