"""Answering a TorchServe batch with per-request isolation: each request is parsed, checked and tokenized on its
own, whatever goes wrong with one becomes that request's own answer (4xx when the input is at fault, 500 when the
server is), and only the survivors are scored, together, or one by one when the batched forward pass fails."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from pipeline.deployment.protocol import (
    Answer,
    Limits,
    ParsedRequest,
    RequestError,
    Scorer,
    error_body,
    format_predictions,
    server_error,
)
from pipeline.deployment.request_parsing import RawRequest, parse_request

log = logging.getLogger(__name__)


def answer_batch(requests: Sequence[RawRequest], scorer: Scorer, limits: Limits,
                 model: str, request_ids: Sequence[str] | None = None) -> list[Answer]:
    """One answer per request, in order; never raises for a request's sake.

    Each request is parsed, checked and tokenized on its own; the survivors' token ids are scored in one
    batch; if that batch fails, each survivor is scored alone so one text that breaks the model fails only
    its own request. Every error answer names its request id (`request_ids`, the server's; the position in the
    batch where none is given), and so does the log line of every server-side failure."""
    ids = [str(r) for r in request_ids] if request_ids is not None else [f"#{i}" for i in range(len(requests))]
    answers = _answers(requests, scorer, limits, model, ids)
    return [a if a.status < 400 else Answer(a.status, {**a.body, "request_id": rid})
            for a, rid in zip(answers, ids, strict=True)]


def _answers(requests: Sequence[RawRequest], scorer: Scorer, limits: Limits, model: str,
             ids: Sequence[str]) -> list[Answer]:
    answers: list[Answer | None] = [None] * len(requests)
    survivors: list[tuple[int, ParsedRequest, list[Any]]] = []
    for idx, request in enumerate(requests):
        try:
            parsed = parse_request(request.body, limits, request.content_type,
                                   content_encoding=request.content_encoding)
            encoded = scorer.encode(parsed.texts)
            if len(encoded) != len(parsed.texts):
                raise RuntimeError(f"tokenizer returned {len(encoded)} sequences for {len(parsed.texts)} texts")
            survivors.append((idx, parsed, encoded))
        except RequestError as err:
            answers[idx] = Answer(err.status, error_body(err))
        except Exception:  # a server fault on this request alone: logged, answered 500, neighbours go on
            log.exception("request %s failed before scoring", ids[idx])
            answers[idx] = server_error()
    for idx, parsed, predictions in _score_survivors(survivors, scorer, ids):
        try:
            if predictions is None:
                answers[idx] = server_error()
            else:
                answers[idx] = Answer(200, format_predictions(predictions, parsed.is_list, model))
        except Exception:
            log.exception("request %s could not be formatted", ids[idx])
            answers[idx] = server_error()
    return [a if a is not None else server_error() for a in answers]


def _score_survivors(survivors: list[tuple[int, ParsedRequest, list[Any]]], scorer: Scorer,
                     ids: Sequence[str]) -> list[tuple[int, ParsedRequest, list[Any] | None]]:
    """Predictions per surviving request (None where scoring it failed): one batch, else one by one."""
    if not survivors:
        return []
    flat = [ids for _, _, encoded in survivors for ids in encoded]
    try:
        predictions = _scored(scorer, flat)
    except Exception:
        log.exception("batched scoring of %d requests failed; scoring them one by one", len(survivors))
    else:
        out: list[tuple[int, ParsedRequest, list[Any] | None]] = []
        start = 0
        for idx, parsed, encoded in survivors:
            out.append((idx, parsed, list(predictions[start : start + len(encoded)])))
            start += len(encoded)
        return out
    alone: list[tuple[int, ParsedRequest, list[Any] | None]] = []
    for idx, parsed, encoded in survivors:
        try:
            alone.append((idx, parsed, _scored(scorer, encoded)))
        except Exception:
            log.exception("request %s: scoring it alone failed", ids[idx])
            alone.append((idx, parsed, None))
    return alone


def _scored(scorer: Scorer, encoded: Sequence[Any]) -> list[Any]:
    """The scorer's predictions for `encoded`, checked to be one per sequence."""
    predictions = list(scorer.score(encoded))
    if len(predictions) != len(encoded):
        raise RuntimeError(f"model returned {len(predictions)} predictions for {len(encoded)} texts")
    return predictions
