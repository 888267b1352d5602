"""Tiny client for the sentiment endpoint: `python -m serving.client "great movie" ["awful film" ...]`.

It reads the inference key from TorchServe's `key_file.json` (token authorization is on). Keys expire
(`token_expiration_min`) and can be replaced with TorchServe's token API, so a request refused for its key is
retried once with a fresh one: the key file is read again (another process may have replaced the key), and
when it still holds the refused key, TorchServe's documented token API (`GET <management>/token?type=inference`
with the file's API key) writes a new one there first.
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any


class KeyFileError(ValueError):
    """The key file exists but holds no complete set of keys, even after waiting for a writer to finish."""


def read_key_file(key_file: Path, settle_s: float = 2.0) -> dict[str, Any] | None:
    """The parsed key file (every key TorchServe wrote), None when there is none. TorchServe creates the file
    before writing it and rewrites it when a key is replaced, so an empty or cut-off file is read again until it
    parses, for up to `settle_s`."""
    deadline = time.monotonic() + settle_s
    while True:
        if not key_file.is_file():
            return None
        try:
            keys = json.loads(key_file.read_bytes())
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError: cut off or being written
            problem = f"not complete JSON ({exc})"
        except OSError as exc:  # removed or replaced since `is_file` (gone: None on the next pass), or unreadable
            problem = f"not readable ({exc.strerror or exc})"
        else:
            if isinstance(keys, dict) and has_key(keys, "inference"):
                return keys
            problem = "no inference key in it"
        if time.monotonic() >= deadline:
            raise KeyFileError(f"{key_file}: {problem} after waiting {settle_s:g} s for TorchServe to write it")
        time.sleep(0.05)


def has_key(keys: dict[str, Any], name: str) -> bool:
    """Whether the key file's `name` entry (`inference`, `API`) holds a key string."""
    entry = keys.get(name)
    return isinstance(entry, dict) and isinstance(entry.get("key"), str)


def inference_key(key_file: Path) -> str | None:
    """The current inference key, or None when the file is absent (token auth disabled); waits out a key file
    that is being written, and raises `KeyFileError` for one that stays unreadable."""
    keys = read_key_file(key_file)
    return keys["inference"]["key"] if keys else None


def is_invalid_key(status: int, body: Any) -> bool:
    """TorchServe's answer to a missing, wrong or expired key: `InvalidKeyException` (400 in 0.12, 401 elsewhere)."""
    return status in (400, 401) and isinstance(body, dict) and body.get("type") == "InvalidKeyException"


def refresh_inference_key(management_url: str, key_file: Path, timeout: float = 10.0) -> str | None:
    """Ask TorchServe for a new inference key with the API key (its token authorization API); the server writes
    the new key to its key file, which is read back. None when there is no key file or the API refuses."""
    keys = read_key_file(key_file)
    if not keys or not has_key(keys, "API"):
        return None
    req = urllib.request.Request(f"{management_url}/token?type=inference",
                                 headers={"Authorization": f"Bearer {keys['API']['key']}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout):
            pass
    except (urllib.error.URLError, OSError):
        return None
    return inference_key(key_file)


def request(method: str, url: str, data: bytes | None = None, key: str | None = None,
            content_type: str = "application/json", timeout: float = 30.0) -> tuple[int, Any]:
    """One HTTP call; returns (status, decoded JSON body, or the text when it is not JSON)."""
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": content_type})
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, body = resp.status, resp.read()
    except urllib.error.HTTPError as err:
        status, body = err.code, err.read()
    try:
        return status, json.loads(body or b"null")
    except ValueError:  # not JSON, or not UTF-8 (UnicodeDecodeError): the text as far as it decodes
        return status, body.decode("utf-8", "replace")


def call_with_key_refresh(method: str, url: str, data: bytes | None, key: str | None, key_file: Path | None,
                          management_url: str | None, timeout: float = 30.0) -> tuple[int, Any, str | None]:
    """`request`, retried once with a fresh inference key when TorchServe refuses the key; returns the key used
    last so a long-lived caller keeps it."""
    status, body = request(method, url, data, key, timeout=timeout)
    if not is_invalid_key(status, body) or key_file is None:
        return status, body, key
    fresh = inference_key(key_file)
    if fresh == key and management_url:  # the file still holds the refused key: it expired, ask for a new one
        fresh = refresh_inference_key(management_url, key_file, timeout)
    if not fresh or fresh == key:
        return status, body, key
    status, body = request(method, url, data, fresh, timeout=timeout)
    return status, body, fresh


def predict(texts: list[str], url: str = "http://127.0.0.1:8080", key: str | None = None, timeout: float = 30.0,
            key_file: Path | None = None, management_url: str | None = None) -> tuple[int, Any]:
    """POST one text (`{"text"}`) or several (`{"texts"}`); returns (HTTP status, decoded JSON body). With
    `key_file` a refused key is refreshed once (see the module doc); `management_url` enables the token API."""
    payload = {"text": texts[0]} if len(texts) == 1 else {"texts": texts}
    status, body, _ = call_with_key_refresh("POST", f"{url}/predictions/sentiment", json.dumps(payload).encode(),
                                            key, key_file, management_url, timeout)
    return status, body


def main(argv: list[str] | None = None) -> None:
    """Print the endpoint's answer for the given reviews."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("texts", nargs="+")
    parser.add_argument("--url", default="http://127.0.0.1:8080")
    parser.add_argument("--management-url", default="http://127.0.0.1:8081",
                        help="for TorchServe's token API when the key expired ('' = never ask for a new key)")
    parser.add_argument("--key-file", type=Path, default=Path("key_file.json"))
    args = parser.parse_args(argv)
    status, body = predict(args.texts, args.url, inference_key(args.key_file), key_file=args.key_file,
                           management_url=args.management_url or None)
    print(json.dumps(body, indent=2))
    if status != 200:
        raise SystemExit(f"HTTP {status}")


if __name__ == "__main__":
    main()
