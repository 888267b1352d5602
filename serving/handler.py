"""TorchServe handler for the sentiment endpoint.

Model logic lives in `pipeline.deployment.inference.SentimentPredictor` and request parsing in `serving.protocol`,
neither of which imports TorchServe, so moving to another server means rewriting only this file. A whole
server-side batch is tokenized and scored in one call; bad requests in a batch get their own 4xx without
failing the others.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class SentimentHandler:
    """Implements TorchServe's `initialize`/`handle` contract without subclassing its internals."""

    def __init__(self) -> None:
        self.predictor: Any = None
        self.limits: Any = None
        self.model_label = "unknown"
        self.initialized = False

    def initialize(self, context: Any) -> None:
        from pipeline.deployment.inference import SentimentPredictor
        from serving.protocol import Limits

        model_dir = Path(context.system_properties.get("model_dir"))
        config = json.loads((model_dir / "serving.json").read_text())
        threads = int(os.environ.get("SENTIMENT_THREADS", config.get("threads") or 0)) or None
        self.predictor = SentimentPredictor(model_dir / config["variant_dir"], threads=threads)
        self.limits = Limits(max_texts=int(config["max_texts"]), max_body_bytes=int(config["max_body_bytes"]))
        self.model_label = config["model"]
        self.predictor.predict(["warm-up review"])  # load kernels before /ping reports healthy
        self.initialized = True
        log.info("sentiment handler ready: %s", self.model_label)

    def handle(self, data: list[dict[str, Any]], context: Any) -> list[Any]:
        from serving.protocol import RequestError, error_body, format_predictions, parse_request

        log.info("batch of %d requests", len(data))  # what TorchServe's server-side batching handed over
        parsed: list[Any] = []
        texts: list[str] = []
        for request in data:
            body = request.get("body") if request.get("body") is not None else request.get("data")
            try:
                p = parse_request(body, self.limits)
                parsed.append((len(texts), p))
                texts.extend(p.texts)
            except RequestError as err:
                parsed.append(err)
        predictions = self.predictor.predict(texts) if texts else []
        responses: list[Any] = []
        for idx, item in enumerate(parsed):
            if isinstance(item, RequestError):
                context.set_response_status(item.status, item.message, idx=idx)
                responses.append(json.dumps(error_body(item)))
                continue
            start, p = item
            responses.append(json.dumps(format_predictions(predictions[start : start + len(p.texts)], p.is_list,
                                                           self.model_label)))
        return responses


_service = SentimentHandler()


def handle(data: list[dict[str, Any]] | None, context: Any) -> list[Any] | None:
    """Module-level entry point TorchServe calls (first call initialises)."""
    if not _service.initialized:
        _service.initialize(context)
    if data is None:
        return None
    return _service.handle(data, context)
