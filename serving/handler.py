"""TorchServe handler for the sentiment endpoint.

Model logic lives in `pipeline.deployment.inference.SentimentPredictor` and the request contract, limits and
per-request isolation in `pipeline.deployment.protocol` (shared with the MLflow server), neither of which
imports TorchServe, so moving to another server means rewriting only this file. Each request of a server-side
batch is parsed and tokenized on its own and the survivors are scored in one call; a bad request gets its own
4xx, a server fault on one request its own 500, and neither touches the other requests of the batch.
"""

from __future__ import annotations

import json
import logging
from http import HTTPStatus
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported when TorchServe first calls the handler, not when it loads this file
    from pipeline.deployment.inference import SentimentPredictor
    from pipeline.deployment.protocol import Answer, Limits
    from pipeline.deployment.request_parsing import RawRequest

log = logging.getLogger(__name__)


class SentimentHandler:
    """Implements TorchServe's `initialize`/`handle` contract without subclassing its internals."""

    def __init__(self) -> None:
        self.predictor: SentimentPredictor | None = None
        self.limits: Limits | None = None
        self.model_label = "unknown"
        self.headers: dict[str, str] = {}
        self.initialized = False

    def initialize(self, context: Any) -> None:
        from pipeline.deployment.inference import SentimentPredictor, freeze_loaded_objects
        from pipeline.deployment.protocol import VARIANT_HEADER, VERSION_HEADER, Limits

        model_dir = Path(context.system_properties.get("model_dir"))
        config = json.loads((model_dir / "serving.json").read_text())
        threads = config.get("threads") or None  # package.threads, written into serving.json by the package stage
        self.limits = Limits.from_config(config)
        self.predictor = SentimentPredictor(model_dir / config["variant_dir"], threads=threads,
                                            max_chars=self.limits.max_chars_per_text)
        self.model_label = config["model"]
        version = (config.get("registered_model") or {}).get("version")
        self.headers = {VERSION_HEADER: str(version or "unregistered"), VARIANT_HEADER: str(config["variant"])}
        self.predictor.predict(["warm-up review"])  # load kernels before /ping reports healthy
        freeze_loaded_objects()
        self.initialized = True
        log.info("sentiment handler ready: %s", self.model_label)

    def handle(self, data: list[dict[str, Any]], context: Any) -> list[str]:
        """One JSON string per request, in order, with each request's status set on the context."""
        from pipeline.deployment.batch_answers import answer_batch
        from pipeline.deployment.protocol import REQUEST_ID_HEADER, server_error

        log.info("batch of %d requests", len(data))  # what TorchServe's server-side batching handed over
        ids = [_request_id(context, idx) for idx in range(len(data))]
        try:
            assert self.predictor is not None and self.limits is not None, "initialize() runs first"
            # a context that cannot give a request's headers is the server's fault: a 500, never the client's 415
            requests = [_raw_request(request, context, idx) for idx, request in enumerate(data)]
            answers = answer_batch(requests, self.predictor, self.limits, self.model_label, ids)
        except Exception:  # answer_batch isolates requests itself; this only keeps a bug from becoming a 503
            log.exception("answering a batch of %d requests (%s) failed", len(data), ", ".join(ids))
            answers = [server_error(rid) for rid in ids]
        responses: list[str] = []
        for idx, answer in enumerate(answers):
            _set_status(context, idx, answer, {**self.headers, REQUEST_ID_HEADER: ids[idx]})
            responses.append(json.dumps(answer.body))
        return responses


def _request_id(context: Any, idx: int) -> str:
    """TorchServe's id of request `idx` of the batch (what its access and model logs name), or a new one."""
    import uuid

    try:
        rid = context.get_request_id(idx)
    except Exception:  # a context without ids (a test's stand-in): the answer still gets one
        rid = None
    return str(rid) if rid else uuid.uuid4().hex


def _raw_request(request: Any, context: Any, idx: int) -> RawRequest:
    """The request body (TorchServe names it `body` or `data`) with its declared content type and content coding,
    if any (a `RawRequest`).

    A form-encoded body never arrives whole: TorchServe splits it into form fields, so the request holds
    neither `body` nor `data`, and the request's own Content-Type header says why (answered 415)."""
    from pipeline.deployment.request_parsing import RawRequest

    if not isinstance(request, dict):
        return RawRequest(None)
    name = "body" if request.get("body") is not None else "data"
    headers = context.get_all_request_header(idx) or {}  # none at all: the protocol answers 415 (no Content-Type)
    sent = {str(k).lower(): v for k, v in headers.items() if str(k).lower() in ("content-type", "content-encoding")}
    # the request's own header, parameters (charset) included; TorchServe's per-input copy drops them
    declared = headers.get(name)
    content_type = sent.get("content-type") if "content-type" in sent else (
        declared.get("content-type") if isinstance(declared, dict) else None)
    return RawRequest(request.get(name), content_type, sent.get("content-encoding"))


def _set_status(context: Any, idx: int, answer: Answer, headers: dict[str, str]) -> None:
    """Status, JSON content type and model headers of one request; the reason phrase is the standard one, the
    body says why."""
    try:
        context.set_response_status(answer.status, HTTPStatus(answer.status).phrase, idx=idx)
        context.set_response_content_type(idx, "application/json")
        for key, value in headers.items():
            context.set_response_header(idx, key, value)
    except Exception:
        log.exception("could not set the response status of request %d", idx)


_service = SentimentHandler()


def handle(data: list[dict[str, Any]] | None, context: Any) -> list[str] | None:
    """Module-level entry point TorchServe calls (first call initialises)."""
    if not _service.initialized:
        _service.initialize(context)
    if data is None:
        return None
    return _service.handle(data, context)
