"""MLflow's scoring server for the champion, behind the request contract: `python -m serving.mlflow_server`
(`make serve-mlflow`).

It loads `models:/<mlflow.registered_model_name>@<mlflow.champion_alias>` (or `--model-uri`) as a pyfunc and
serves it under uvicorn, in one process: MLflow's own scoring app (`mlflow.pyfunc.scoring_server`, what `mlflow
models serve` runs) answers `/ping`, `/health` and `/version`, and scoring goes to the pyfunc MLflow loaded
(`served_model`: for this project's models, the predictor its `predict` calls, on the checked texts, without the
DataFrames around it; any other pyfunc through `PyFuncModel.predict`). In front of both:

- `serving.contract_middleware.ContractMiddleware` holds the request contract of `pipeline.deployment.protocol`
  (limits, checks, error classes, request ids, `/ready`, `/metrics`) in ASGI, and `serving.scoring_queue` batches
  the checked texts of concurrent requests into one model call at a time on the model's own thread;
- `serving.request_deadline` is uvicorn's h11 protocol with the deadlines uvicorn lacks (slow-HTTP "slowloris"
  connections hold nothing past `--header-timeout`, a client that reads none of its answers is dropped after
  `--send-timeout`), a budget on a body's small pieces, and the contract's JSON answers where uvicorn would answer
  plain text; `--limit-concurrency` connections at most, one more answered 503 with `Retry-After` and closed, so a
  per-client connection cap belongs to the proxy in front (docs/serving.md);
- logs go to `<log-dir>/mlflow_server.log`, appended across restarts and rotated by size.

Several processes would each hold a copy of the model and split the cores between smaller forward passes, so the
server is one process.
"""

from __future__ import annotations

import argparse
import logging
import logging.config
import re
from pathlib import Path
from typing import Any

from pipeline.deployment.protocol import VARIANT_HEADER, VERSION_HEADER, Limits
from serving.contract_middleware import BODY_TIMEOUT_S, MAX_IN_FLIGHT, ContractMiddleware
from serving.endpoint_metrics import Metrics

log = logging.getLogger("serving.mlflow_server")

#: Bytes h11 buffers for a request line and headers not yet complete; past it the protocol answers the contract's
#: JSON 400 before the app. A header section that arrives whole is parsed whatever its size (one socket read is
#: at most 256 KiB) and gets the middleware's 431 past 8 KiB.
H11_MAX_HEADER_BYTES = 65536
#: Seconds a connection may take to send a request's line and headers (from its opening or its last answer) before
#: it is closed, with a 408 if a request had begun (`--header-timeout`; nginx's `client_header_timeout` in
#: serving/nginx.conf is 10 s).
HEADER_TIMEOUT_S = 10.0
#: Seconds an answer may wait for a client that reads none of it (the connection's send buffer full) before the
#: connection is dropped; `--send-timeout` (nginx's `send_timeout` is 30 s).
SEND_TIMEOUT_S = 30.0


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


def served_version(model_uri: str | None, *, name: str, alias: str, tracking_uri: str) -> tuple[str, dict[str, str]]:
    """The registry version a model URI names in store `tracking_uri` and that version's tags: the champion
    (`models:/<name>@<alias>`) when no URI is given, the alias or version of a `models:/<name>@<alias>` or
    `models:/<name>/<version>` URI, and "unregistered" for any other model (a LoggedModel id, a path)."""
    from pipeline.core.model_registry import registered_version, version_tags

    if model_uri is None:
        return registered_version(name, alias, tracking_uri=tracking_uri)
    if m := re.fullmatch(r"models:/([^/@]+)@([^/]+)", model_uri):
        return registered_version(m[1], m[2], tracking_uri=tracking_uri)
    if m := re.fullmatch(r"models:/([^/@]+)/(\d+)", model_uri):
        return m[2], version_tags(m[1], m[2], tracking_uri=tracking_uri)
    return "unregistered", {}


def served_limits(tags: dict[str, str], fallback: Limits, *, tracking_uri: str) -> tuple[Limits, str]:
    """The request limits a registered version was packaged with, as its package run recorded them (`package.*`
    params of the run its tags name, `version_package_params`; the version's `.mar` holds the same in serving.json),
    and where they came from. `fallback` (params' package section) where the version names no such run, or the run
    holds no complete set (a model registered by hand, or before the limits were recorded)."""
    from pipeline.core.model_registry import version_package_params

    try:
        recorded = version_package_params(tags, tracking_uri=tracking_uri)
        if recorded is not None:
            return Limits.from_config(recorded[1]), f"the version's package run {recorded[0]}"
    except (LookupError, ValueError) as exc:
        log.warning("the limits the served version was packaged with could not be read (%s): params' are used", exc)
    return fallback, "params' package section"


def build_app(model_uri: str | None, params_path: Path, max_in_flight: int = MAX_IN_FLIGHT,
              body_timeout_s: float = BODY_TIMEOUT_S, limits_from: str = "model") -> ContractMiddleware:
    """Load the champion (or `model_uri`) and serve it through the contract, with the limits the served version was
    packaged with (`served_limits`: what its `.mar` enforces on TorchServe) or, `limits_from="params"`, params'. The
    store (`$MLFLOW_TRACKING_URI`, else the params') is read once and handed to every registry lookup and to the
    model's download: MLflow's process-wide tracking URI and the environment are left as they are."""
    from pipeline.core.params import load_params_or_defaults
    from pipeline.core.parent_run import tracking_uri
    from pipeline.deployment.mlflow_model import served_model

    params = load_params_or_defaults(params_path)
    store = tracking_uri(params.mlflow)
    name, alias = params.mlflow.registered_model_name, params.mlflow.champion_alias
    version, tags = served_version(model_uri, name=name, alias=alias, tracking_uri=store)
    requested = uri = model_uri or f"models:/{name}@{alias}"
    if (m := re.fullmatch(r"models:/([^/@]+)@([^/]+)", uri)) and version.isdigit():
        # load the version just resolved, not the alias again: an alias moved in between (a `make run` finishing)
        # would serve one version under the other's number
        uri = f"models:/{m[1]}/{version}"
    model = served_model(uri, tracking_uri=store)
    variant = model.variant or tags.get("variant", "unknown")
    log.info("serving %s (%s, version %s, variant %s) from %s", requested, uri, version, variant, store)
    configured = Limits.from_config(vars(params.package))
    if limits_from == "model":
        limits, source = served_limits(tags, configured, tracking_uri=store)
    else:
        limits, source = configured, f"params ({params_path})"
    if limits != configured:
        changed = {k: v for k, v in vars(configured).items() if getattr(limits, k) != v}
        log.warning("the limits of %s (%s) differ from params' package section (%s): the version's are enforced, as "
                    "its .mar does; --limits params enforces params'", source, vars(limits), changed)
    log.info("request limits from %s: %s", source, vars(limits))
    return ContractMiddleware(model.app, model.score, limits, version, variant, Metrics(version, variant),
                              timeout_s=model.timeout_s, max_in_flight=max_in_flight, body_timeout_s=body_timeout_s)


def main(argv: list[str] | None = None) -> None:
    """Serve until interrupted."""
    import uvicorn

    from serving.request_deadline import request_deadline_protocol

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=5001)
    parser.add_argument("--params", type=Path, default=Path("params.yaml"),
                        help="the registry entry (mlflow.*) and the limits (package.*) of a model whose package run "
                             "recorded none; defaults if params.yaml is absent")
    parser.add_argument("--limits", choices=["model", "params"], default="model",
                        help="model: the limits the served version was packaged with (as its .mar enforces them); "
                             "params: params' package section")
    parser.add_argument("--model-uri", help="serve this model instead of models:/<name>@<alias> (same limits)")
    parser.add_argument("--log-dir", type=Path, default=Path("logs"))
    parser.add_argument("--log-max-bytes", type=int, default=10_000_000)
    parser.add_argument("--log-backups", type=int, default=5)
    parser.add_argument("--max-in-flight", type=int, default=MAX_IN_FLIGHT,
                        help="scoring requests answered at once; one more is answered 503 with Retry-After")
    parser.add_argument("--limit-concurrency", type=int, default=256,
                        help="connections open at once (above --max-in-flight); one more is answered 503 with "
                             "Retry-After and closed")
    parser.add_argument("--header-timeout", type=float, default=HEADER_TIMEOUT_S,
                        help="seconds a connection may take to send a request's line and headers (408 and closed)")
    parser.add_argument("--body-timeout", type=float, default=BODY_TIMEOUT_S,
                        help="seconds a request may take to send its body (408 and closed)")
    parser.add_argument("--send-timeout", type=float, default=SEND_TIMEOUT_S,
                        help="seconds an answer may wait for a client that reads none of it (then dropped)")
    args = parser.parse_args(argv)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    config = log_config(args.log_dir, args.log_max_bytes, args.log_backups)
    logging.config.dictConfig(config)
    from pipeline.core.model_registry import StoreError, store_errors
    from pipeline.core.params import ParamsError

    try:
        with store_errors():
            app = build_app(args.model_uri, args.params, args.max_in_flight, args.body_timeout, args.limits)
    except LookupError as exc:  # no champion yet: say what to do instead of a traceback
        raise SystemExit(f"{exc}: run `make run` first (its package stage registers and aliases the model)") from None
    except FileNotFoundError as exc:  # a --params that is not there
        raise SystemExit(str(exc)) from None
    except ParamsError as exc:  # a --params that is not valid
        raise SystemExit(f"{args.params}: {exc}") from None
    except StoreError as exc:  # the store unreachable or refusing, a version or model it does not have
        raise SystemExit(f"the model to serve could not be read from the tracking store: {exc}") from None
    from pipeline.deployment.inference import freeze_loaded_objects

    freeze_loaded_objects()  # after the model's load: a request's collections never walk its objects
    print(f"serving {app.variant} (version {app.version}) at http://{args.host}:{args.port}/invocations; "
          f"logs in {args.log_dir / 'mlflow_server.log'}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port,
                http=request_deadline_protocol(args.header_timeout, args.send_timeout, args.limit_concurrency,
                                               [(VERSION_HEADER, app.version), (VARIANT_HEADER, app.variant)],
                                               on_refusal=app.metrics.refused),
                h11_max_incomplete_event_size=H11_MAX_HEADER_BYTES, timeout_keep_alive=5, server_header=False,
                # the logged client is the socket's peer: uvicorn would take X-Forwarded-For from any loopback
                # client, and every client of a server bound to 127.0.0.1 is one, so it would log what callers write
                proxy_headers=False, log_config=config)


if __name__ == "__main__":
    from pipeline.core.process_exit import skip_final_collection

    skip_final_collection()
    main()
