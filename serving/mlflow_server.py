"""MLflow's scoring server for the champion, behind the request contract: `python -m serving.mlflow_server`
(`make serve-mlflow`).

It serves MLflow's own scoring app (`mlflow.pyfunc.scoring_server`, what `mlflow models serve` runs) for
`models:/<mlflow.registered_model_name>@<mlflow.champion_alias>` under uvicorn, as `mlflow models serve` does,
in one process, wrapped in `ContractMiddleware` (ASGI). MLflow's app parses a body with Python's `json` before
the model sees it (no size or depth limit, NaN and 10**5000 accepted, a deep body a 500, errors that echo the
input); the middleware holds the contract of `pipeline.deployment.protocol` in front of it instead:

- only `POST /invocations`, `GET /ping|/health|/version|/ready|/metrics` are answered (405/404 otherwise);
- URL and header sizes are bounded (414/431; uvicorn's h11 parser refuses far larger ones itself);
- the body is read up to `package.max_body_bytes` (413 beyond, from Content-Length or while reading), then
  parsed and checked exactly as TorchServe's handler does, with MLflow's shapes (`dataframe_split`,
  `dataframe_records`, `inputs`, `instances`, CSV); only a valid body reaches MLflow's app and the pyfunc, as
  the `dataframe_split` of the texts checked (so pandas never re-reads a CSV review "NA" as missing);
- any non-200 answer of MLflow's app is replaced by the contract's bounded JSON error (never the input);
- every answer carries `X-Model-Version` and `X-Model-Variant`; `/metrics` is Prometheus text (requests,
  latency histogram, errors by kind); `/ready` scores one review through the whole stack (readiness);
- logs go to `<log-dir>/mlflow_server.log`, appended across restarts and rotated by size.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import logging.config
import os
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.deployment.protocol import (
    MLFLOW_SHAPES,
    TEXT_COLUMN,
    VARIANT_HEADER,
    VERSION_HEADER,
    Limits,
    RequestError,
    error_body,
)
from pipeline.deployment.request_parsing import parse_request

log = logging.getLogger("serving.mlflow_server")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

INVOCATIONS = "/invocations"
#: Paths and the methods answered on them; everything else is 404 (unknown path) or 405 (other method).
ROUTES = {INVOCATIONS: "POST", "/ping": "GET", "/health": "GET", "/version": "GET", "/ready": "GET",
          "/metrics": "GET"}
MAX_URL_BYTES = 2048
MAX_HEADER_BYTES = 8192
#: uvicorn's h11 parser refuses a request line plus headers beyond this itself (a plain 400), before the app.
H11_MAX_HEADER_BYTES = 65536
READY_BODY = b'{"inputs": ["readiness probe: a fine film"]}'
ERROR_KINDS = {400: "invalid_input", 404: "not_found", 405: "method_not_allowed", 413: "too_large",
               414: "uri_too_long", 415: "unsupported_media_type", 431: "headers_too_large", 503: "unavailable",
               504: "timeout"}


class Metrics:
    """Prometheus metrics of the endpoint, in a registry of their own (`/metrics`)."""

    def __init__(self, version: str, variant: str) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter("sentiment_requests", "Requests answered, by path, method and status",
                                ["path", "method", "status"], registry=self.registry)
        self.latency = Histogram("sentiment_request_latency_seconds", "Time to answer a request, by path",
                                 ["path"], registry=self.registry,
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0))
        self.errors = Counter("sentiment_request_errors", "Requests answered with an error, by kind",
                              ["kind"], registry=self.registry)
        self.texts = Counter("sentiment_texts_scored", "Texts scored (valid requests answered 200)",
                             registry=self.registry)
        Gauge("sentiment_model_info", "The served model (always 1)", ["version", "variant"],
              registry=self.registry).labels(version, variant).set(1)

    def observe(self, path: str, method: str, status: int, seconds: float, texts: int) -> None:
        path = path if path in ROUTES else "other"  # unknown paths never become label values
        method = method if method in ("GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS") else "other"
        self.requests.labels(path, method, str(status)).inc()
        self.latency.labels(path).observe(seconds)
        if status >= 400:
            self.errors.labels(ERROR_KINDS.get(status, "server_error" if status >= 500 else "other")).inc()
        elif texts:
            self.texts.inc(texts)

    def exposition(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


@dataclass
class ContractMiddleware:
    """ASGI middleware holding the request contract in front of MLflow's scoring app (see the module doc)."""

    app: App
    limits: Limits
    version: str
    variant: str
    metrics: Metrics

    @property
    def model_headers(self) -> list[tuple[bytes, bytes]]:
        return [(VERSION_HEADER.lower().encode(), self.version.encode()),
                (VARIANT_HEADER.lower().encode(), self.variant.encode())]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan: MLflow's app has nothing to start
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        texts = 0
        try:
            status, texts = await self._answer(scope, receive, send)
        except Exception:
            log.exception("answering %s %s failed", scope.get("method"), scope.get("path"))
            status = 500
            await self._json(send, 500, {"error": "internal error while answering this request (logged on "
                                                  "the server)", "status": 500})
        self.metrics.observe(scope.get("path", ""), scope.get("method", ""), status, time.perf_counter() - start,
                             texts)

    async def _answer(self, scope: Scope, receive: Receive, send: Send) -> tuple[int, int]:
        """Answer one HTTP request; returns (status, texts scored)."""
        path, method = scope.get("path", ""), scope.get("method", "")
        url_bytes = len(scope.get("raw_path") or path.encode()) + len(scope.get("query_string") or b"")
        if url_bytes > MAX_URL_BYTES:
            return await self._error(send, RequestError(414, f"URL of {url_bytes} bytes exceeds the limit of "
                                                             f"{MAX_URL_BYTES}")), 0
        header_bytes = sum(len(k) + len(v) + 4 for k, v in scope.get("headers", []))
        if header_bytes > MAX_HEADER_BYTES:
            return await self._error(send, RequestError(431, f"request headers of {header_bytes} bytes exceed "
                                                             f"the limit of {MAX_HEADER_BYTES}")), 0
        allowed = ROUTES.get(path)
        if allowed is None:
            return await self._error(send, RequestError(404, "no such path; scoring is POST /invocations")), 0
        if method != allowed:
            return await self._error(send, RequestError(405, f"method not allowed on this path; use {allowed}"),
                                     [(b"allow", allowed.encode())]), 0
        if path == "/metrics":
            body, content_type = self.metrics.exposition()
            await self._send(send, 200, body, content_type)
            return 200, 0
        if path == "/ready":
            return await self._ready(send), 0
        if path != INVOCATIONS:
            return await self._forward(scope, b"", send), 0
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        try:
            body = await self._body(headers, receive)
            parsed = parse_request(body, self.limits, headers.get("content-type"), MLFLOW_SHAPES)
        except RequestError as err:
            return await self._error(send, err), 0
        # MLflow's app gets the texts the contract checked, in one canonical JSON form: pandas would otherwise read
        # a CSV review "NA" or "null" as a missing value, and the shapes would each be converted their own way.
        canonical = json.dumps({"dataframe_split": {"columns": [TEXT_COLUMN],
                                                    "data": [[t] for t in parsed.texts]}}).encode()
        status = await self._forward(_as_json(scope, len(canonical)), canonical, send)
        return status, len(parsed.texts) if status == 200 else 0

    async def _body(self, headers: dict[str, str], receive: Receive) -> bytes:
        """The request body, refused (413) as soon as it is known to exceed `max_body_bytes`."""
        limit = self.limits.max_body_bytes
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise RequestError(413, f"request body of {int(declared)} bytes exceeds the limit of {limit}")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise RequestError(400, "the client closed the connection before the body was complete")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise RequestError(413, f"request body of more than {limit} bytes exceeds the limit of {limit}")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _forward(self, scope: Scope, body: bytes, send: Send) -> int:
        """Run MLflow's app on `body`; a 200 goes out with the model headers, anything else becomes the
        contract's JSON error (MLflow's own error bodies quote the input and may be any size)."""
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if sent:
                await asyncio.Event().wait()  # the body was consumed: as a client that keeps the connection open
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        start: Message = {}
        parts: list[bytes] = []

        async def capture(message: Message) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
                if message["status"] == 200:
                    headers = [h for h in message.get("headers", []) if h[0].lower() != b"server"]
                    await send({**message, "headers": [*headers, *self.model_headers]})
            elif message["type"] == "http.response.body":
                if start.get("status") == 200:
                    await send(message)
                elif sum(map(len, parts)) < 2048:
                    parts.append(message.get("body", b"")[:2048])

        await self.app(scope, replay, capture)
        status = int(start.get("status", 500))
        if status != 200:
            log.warning("MLflow's scoring app answered %d: %s", status,
                        b"".join(parts)[:300].decode("utf-8", "replace"))
            status = status if 400 <= status < 600 else 500
            message = ("the scoring server refused this input" if status < 500 else
                       "internal error while scoring this request (logged on the server)")
            await self._json(send, status, {"error": message, "status": status})
        return status

    async def _ready(self, send: Send) -> int:
        """200 with the model when one review goes through MLflow's app and the pyfunc, else 503."""
        scope = {"type": "http", "method": "POST", "path": INVOCATIONS, "raw_path": INVOCATIONS.encode(),
                 "query_string": b"", "headers": [(b"content-type", b"application/json")], "http_version": "1.1"}
        status = await self._forward(scope, READY_BODY, _discard)
        ok = status == 200
        await self._json(send, 200 if ok else 503, {"status": "ready" if ok else "not ready",
                                                    "version": self.version, "variant": self.variant})
        return 200 if ok else 503

    async def _error(self, send: Send, err: RequestError, extra: list[tuple[bytes, bytes]] | None = None) -> int:
        await self._json(send, err.status, error_body(err), extra)
        return err.status

    async def _json(self, send: Send, status: int, body: dict[str, Any],
                    extra: list[tuple[bytes, bytes]] | None = None) -> None:
        await self._send(send, status, json.dumps(body).encode(), "application/json", extra)

    async def _send(self, send: Send, status: int, body: bytes, content_type: str,
                    extra: list[tuple[bytes, bytes]] | None = None) -> None:
        headers = [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode()),
                   *self.model_headers, *(extra or [])]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})


def _as_json(scope: Scope, length: int) -> Scope:
    """`scope` with its Content-Type and Content-Length headers replaced for a JSON body of `length` bytes."""
    headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() not in (b"content-type", b"content-length")]
    return {**scope, "headers": [*headers, (b"content-type", b"application/json"),
                                 (b"content-length", str(length).encode())]}


async def _discard(message: Message) -> None:
    """A `send` that drops what it is given (the readiness probe's own request)."""


def log_config(log_dir: Path, max_bytes: int, backups: int) -> dict[str, Any]:
    """uvicorn's and this module's loggers into one size-rotated file, appended across restarts, and warnings
    to the console."""
    handler = {"class": "logging.handlers.RotatingFileHandler", "filename": str(log_dir / "mlflow_server.log"),
               "maxBytes": max_bytes, "backupCount": backups, "encoding": "utf-8", "mode": "a",
               "formatter": "plain"}
    console = {"class": "logging.StreamHandler", "level": "WARNING", "formatter": "plain"}
    loggers = {name: {"handlers": ["file", "console"], "level": "INFO", "propagate": False}
               for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "serving", "mlflow")}
    return {"version": 1, "disable_existing_loggers": False,
            "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
            "handlers": {"file": handler, "console": console}, "loggers": loggers,
            "root": {"handlers": ["file", "console"], "level": "WARNING"}}


def build_app(model_uri: str | None, params_path: Path) -> ContractMiddleware:
    """Load the champion (or `model_uri`) and wrap MLflow's scoring app for it in the contract."""
    from pipeline.core.model_registry import registered_version
    from pipeline.core.params import load_params
    from pipeline.core.parent_run import tracking_uri
    from pipeline.deployment.mlflow_model import scoring_app

    params = load_params(params_path) if params_path.is_file() else None
    if params is None:
        from pipeline.core.params import Params

        params = Params()
    os.environ["MLFLOW_TRACKING_URI"] = tracking_uri(params.mlflow)
    name, alias = params.mlflow.registered_model_name, params.mlflow.champion_alias
    version, tags = registered_version(name, alias)
    uri = model_uri or f"models:/{name}@{alias}"
    log.info("serving %s (version %s, variant %s) from %s", uri, version, tags.get("variant"),
             os.environ["MLFLOW_TRACKING_URI"])
    limits = Limits.from_config(vars(params.package))
    variant = tags.get("variant", "unknown")
    return ContractMiddleware(scoring_app(uri), limits, version, variant, Metrics(version, variant))


def main(argv: list[str] | None = None) -> None:
    """Serve until interrupted."""
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=5001)
    parser.add_argument("--params", type=Path, default=Path("params.yaml"),
                        help="limits (package.*) and the registry entry (mlflow.*); defaults if absent")
    parser.add_argument("--model-uri", help="serve this model instead of models:/<name>@<alias> (same limits)")
    parser.add_argument("--log-dir", type=Path, default=Path("logs"))
    parser.add_argument("--log-max-bytes", type=int, default=10_000_000)
    parser.add_argument("--log-backups", type=int, default=5)
    parser.add_argument("--limit-concurrency", type=int, default=256,
                        help="connections plus tasks at once; uvicorn answers 503 beyond")
    args = parser.parse_args(argv)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    config = log_config(args.log_dir, args.log_max_bytes, args.log_backups)
    logging.config.dictConfig(config)
    try:
        app = build_app(args.model_uri, args.params)
    except LookupError as exc:  # no champion yet: say what to do instead of a traceback
        raise SystemExit(f"{exc}: run `make run` first (its package stage registers and aliases the model)") from None
    print(f"serving {app.variant} (version {app.version}) at http://{args.host}:{args.port}/invocations; "
          f"logs in {args.log_dir / 'mlflow_server.log'}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, http="h11", h11_max_incomplete_event_size=H11_MAX_HEADER_BYTES,
                limit_concurrency=args.limit_concurrency, timeout_keep_alive=5, server_header=False,
                log_config=config)


if __name__ == "__main__":
    main()
