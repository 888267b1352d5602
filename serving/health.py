"""Health probe for the sentiment endpoint, run on the server's own host or container:
`python -m serving.health [--predict] [--wait SECONDS]`; exit status 0 when healthy, 1 otherwise, one line on stdout.

TorchServe puts token authorization in front of every inference-API path, `/ping` included, and has no
setting that exempts it (only `disable_token_authorization`, which opens everything). So the probe runs
where `key_file.json` is and reads the key there: it never travels through the proxy or into probe
configuration. An expired key is replaced through TorchServe's token API (see `serving.client`).
`--predict` also scores one review: `/ping` reports the worker healthy while its model may still be loading.
The metrics API (`metrics_address`) answers without a key, but only tells the frontend process is up.
`--wait` probes once a second until healthy or the time is up: what `make serve` waits with after
`torchserve --start`, which returns before the worker has loaded the model and written the key file.
"""

from __future__ import annotations

import argparse
import http.client
import json
import time
from collections.abc import Callable
from pathlib import Path

from serving.client import KeyFileError, call_with_key_refresh, inference_key


def probe(url: str, key_file: Path, management_url: str | None, predict: bool, timeout: float) -> tuple[bool, str]:
    """(healthy, what was seen) for `/ping`, then optionally one prediction. A key file still being written, a
    refused connection and an answer cut short are each an unhealthy probe: all three happen while TorchServe
    starts."""
    try:
        key = inference_key(key_file)
    except KeyFileError as exc:
        return False, f"key file not readable yet: {exc}"
    try:  # a refused key re-reads the key file, which may be being rewritten (KeyFileError)
        status, body, key = call_with_key_refresh("GET", f"{url}/ping", None, key, key_file, management_url, timeout)
    except (OSError, http.client.HTTPException, KeyFileError) as exc:
        return False, f"/ping unreachable: {exc}"
    if status != 200 or not isinstance(body, dict) or body.get("status") != "Healthy":
        return False, f"/ping answered {status}: {body}"
    if not predict:
        return True, "/ping: Healthy"
    data = json.dumps({"text": "health probe: a fine film"}).encode()
    try:
        status, body, _ = call_with_key_refresh("POST", f"{url}/predictions/sentiment", data, key, key_file,
                                                management_url, timeout)
    except (OSError, http.client.HTTPException, KeyFileError) as exc:
        return False, f"prediction unreachable: {exc}"
    if status != 200 or not isinstance(body, dict) or "label" not in body:
        return False, f"prediction answered {status}: {body}"
    return True, f"/ping: Healthy; prediction: {body['label']}"


def wait_until_healthy(url: str, key_file: Path, management_url: str | None, predict: bool, timeout: float,
                       wait: float, interval: float = 1.0, clock: Callable[[], float] = time.monotonic,
                       sleep: Callable[[float], None] = time.sleep) -> tuple[bool, str]:
    """`probe` once every `interval` seconds until it says healthy or `wait` seconds have passed; (healthy, what
    the last probe saw)."""
    deadline = clock() + wait
    while True:
        healthy, seen = probe(url, key_file, management_url, predict, timeout)
        if healthy or clock() >= deadline:
            return healthy, seen
        sleep(interval)


def main(argv: list[str] | None = None) -> None:
    """Probe and exit 0 (healthy) or 1."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8080")
    parser.add_argument("--management-url", default="http://127.0.0.1:8081",
                        help="TorchServe's token API, for an expired key ('' = never ask for a new key)")
    parser.add_argument("--key-file", type=Path, default=Path("key_file.json"))
    parser.add_argument("--predict", action="store_true", help="also score one review (readiness)")
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("--wait", type=float, default=0.0,
                        help="probe once a second until healthy, for up to this many seconds (0: probe once)")
    args = parser.parse_args(argv)
    healthy, seen = wait_until_healthy(args.url, args.key_file, args.management_url or None, args.predict,
                                       args.timeout, args.wait)
    print(seen)
    raise SystemExit(0 if healthy else 1)


if __name__ == "__main__":
    main()
