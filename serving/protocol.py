"""The sentiment endpoint's request/response contract, independent of TorchServe.

Accepted bodies: JSON `{"text": "..."}`, JSON `{"texts": ["...", ...]}` (at most `max_texts`), or a
plain-text body holding one review. Every malformed request maps to a `RequestError` with an HTTP 4xx
status and a message saying what was wrong; nothing in a request is ever evaluated.

`answer_batch` answers a server-side batch with per-request isolation: each request is parsed, checked and
tokenized on its own, whatever goes wrong with one becomes that request's own answer (4xx when the input is
at fault, 500 when the server is), and only the survivors are scored, together, or one by one when the
batched forward pass fails.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

log = logging.getLogger(__name__)

# Largest integer a JSON number may hold: what still fits a double, the same bound orjson enforces on bodies
# it parses, applied to JSON the server decoded itself (Python's json turns any digit string into an int).
MAX_INT_BITS = 1024
JSON_MEDIA_TYPES = ("application/json",)


class RequestError(ValueError):
    """A request the endpoint rejects, with the HTTP status to answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Limits:
    """Documented limits of the endpoint (`package.*` in params.yaml, carried by the archive's serving.json)."""

    max_texts: int = 64
    max_body_bytes: int = 1_000_000
    max_chars_per_text: int = 20_000  # applied by the predictor (texts are cut, not refused)
    max_json_depth: int = 8

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Limits:
        """The limits recorded in serving.json; keys an older archive lacks keep their defaults."""
        names = ("max_texts", "max_body_bytes", "max_chars_per_text", "max_json_depth")
        return cls(**{name: int(config[name]) for name in names if config.get(name) is not None})


@dataclass(frozen=True)
class ParsedRequest:
    """Texts to score, and whether the caller sent a list (answered with a list)."""

    texts: list[str]
    is_list: bool


@dataclass(frozen=True)
class Answer:
    """One request's answer: the HTTP status and the JSON-serialisable body."""

    status: int
    body: Any


class Scorer(Protocol):
    """What `answer_batch` needs of the model: tokenize one request's texts, score token ids in one batch."""

    def encode(self, texts: Sequence[str]) -> list[Any]: ...

    def score(self, encoded: Sequence[Any]) -> list[Any]: ...


def is_json_media_type(content_type: str | None) -> bool:
    """`application/json` or a `+json` suffix type, parameters (charset) ignored."""
    if not content_type:
        return False
    media = content_type.split(";", 1)[0].strip().lower()
    return media in JSON_MEDIA_TYPES or media.endswith("+json")


def parse_request(body: Any, limits: Limits, content_type: str | None = None) -> ParsedRequest:
    """Turn one request body into texts, or raise `RequestError` (and nothing else).

    `body` is what the server hands over: bytes (the normal case: serving/config.properties turns
    TorchServe's own decoding off), a str (a text body the server decoded) or JSON the server already
    decoded (dict, list or scalar). The same limits hold for each: already-decoded JSON is walked without
    recursion and its encoded size estimated, since the original bytes are gone."""
    if isinstance(body, bytes | bytearray | memoryview):
        raw = bytes(body)
    elif isinstance(body, str):
        raw = body.encode("utf-8", "surrogatepass")  # the size the client sent; surrogates are refused below
    elif body is None:
        raise RequestError(400, "empty request body; send {\"text\": \"...\"} or a plain-text review")
    else:
        return _from_payload(_checked_tree(body, limits, decoded_by_server=True), limits)
    if len(raw) > limits.max_body_bytes:
        raise RequestError(413, f"request body of {len(raw)} bytes exceeds the limit of {limits.max_body_bytes}")
    if not raw.strip():
        raise RequestError(400, "empty request body; send {\"text\": \"...\"} or a plain-text review")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(400, f"request body is not valid UTF-8 (byte {exc.start})") from None
    if is_json_media_type(content_type) or text.lstrip().startswith(("{", "[")):
        try:
            payload = orjson.loads(raw)  # refuses NaN/Infinity, lone surrogates, numbers beyond a double, depth > 1024
        except orjson.JSONDecodeError as exc:
            raise RequestError(400, f"invalid JSON: {exc}") from None
        return _from_payload(_checked_tree(payload, limits, decoded_by_server=False), limits)
    return ParsedRequest([_check_text(text, "body")], is_list=False)


def _checked_tree(payload: Any, limits: Limits, decoded_by_server: bool) -> Any:
    """Refuse JSON nested deeper than `max_json_depth`, numbers outside a double's range, non-JSON types and
    (for JSON the server decoded) an encoded size above `max_body_bytes`. Iterative, so no nesting depth can
    exhaust the stack; stops at the first violation."""
    size = 0
    stack: list[tuple[Any, int]] = [(payload, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            if depth + 1 > limits.max_json_depth:
                raise RequestError(400, f"JSON nested more than {limits.max_json_depth} levels deep")
            size += 2 + len(node)  # brackets and separators
            if isinstance(node, dict):
                for key in node:
                    if not isinstance(key, str):
                        raise RequestError(400, f"JSON object key of type {type(key).__name__}")
                    size += len(key) + 3
                stack.extend((value, depth + 1) for value in node.values())
            else:
                stack.extend((value, depth + 1) for value in node)
        elif isinstance(node, str):
            size += len(node.encode("utf-8", "surrogatepass")) + 2  # quotes; escapes would only add more
        elif node is None or isinstance(node, bool):
            size += 5
        elif isinstance(node, int):
            if node.bit_length() > MAX_INT_BITS:
                raise RequestError(400, f"JSON number too large (more than {MAX_INT_BITS} bits)")
            size += node.bit_length() // 3 + 1
        elif isinstance(node, float):
            if not math.isfinite(node):
                raise RequestError(400, "JSON number is NaN or infinite")
            size += 8
        else:
            raise RequestError(400, f"request body of unsupported type {type(node).__name__}")
        if decoded_by_server and size > limits.max_body_bytes:
            raise RequestError(413, f"request body of at least {size} bytes exceeds the limit of "
                                    f"{limits.max_body_bytes}")
    return payload


def _from_payload(payload: Any, limits: Limits) -> ParsedRequest:
    if not isinstance(payload, dict):
        raise RequestError(400, f"JSON body must be an object with \"text\" or \"texts\", got {_json_type(payload)}")
    if "texts" in payload:
        texts = payload["texts"]
        if not isinstance(texts, list):
            raise RequestError(400, f"\"texts\" must be a list of strings, got {_json_type(texts)}")
        if not texts:
            raise RequestError(400, "\"texts\" is empty")
        if len(texts) > limits.max_texts:
            raise RequestError(413, f"{len(texts)} texts exceed the maximum of {limits.max_texts} per request")
        return ParsedRequest([_check_text(t, f"texts[{i}]") for i, t in enumerate(texts)], is_list=True)
    if "text" in payload:
        return ParsedRequest([_check_text(payload["text"], "text")], is_list=False)
    raise RequestError(400, "JSON body needs a \"text\" string or a \"texts\" list")


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number" if isinstance(value, int | float) else type(value).__name__)


def _check_text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise RequestError(400, f"{where} must be a string, got {_json_type(value)}")
    if not value.strip():
        raise RequestError(400, f"{where} is empty or whitespace only")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:  # JSON decoded by the server may hold "\ud800"; no tokenizer takes it
        raise RequestError(400, f"{where} holds a lone UTF-16 surrogate at character {exc.start}") from None
    return value


def format_predictions(predictions: Sequence[Any], is_list: bool, model: str) -> Any:
    """`{"label", "score", "model"}` per text; a list when the request sent a list."""
    items = [{"label": p.label, "score": round(float(p.score), 6), "model": model} for p in predictions]
    return items if is_list else items[0]


def error_body(err: RequestError) -> dict[str, Any]:
    """The JSON error answered with a 4xx status."""
    return {"error": err.message, "status": err.status}


SERVER_ERROR = Answer(500, {"error": "internal error while scoring this request (logged on the server)",
                            "status": 500})


def answer_batch(requests: Sequence[tuple[Any, str | None]], scorer: Scorer, limits: Limits,
                 model: str) -> list[Answer]:
    """One answer per `(body, content_type)`, in order; never raises for a request's sake.

    Each request is parsed, checked and tokenized on its own; the survivors' token ids are scored in one
    batch; if that batch fails, each survivor is scored alone so one text that breaks the model fails only
    its own request."""
    answers: list[Answer | None] = [None] * len(requests)
    survivors: list[tuple[int, ParsedRequest, list[Any]]] = []
    for idx, (body, content_type) in enumerate(requests):
        try:
            parsed = parse_request(body, limits, content_type)
            encoded = scorer.encode(parsed.texts)
            if len(encoded) != len(parsed.texts):
                raise RuntimeError(f"tokenizer returned {len(encoded)} sequences for {len(parsed.texts)} texts")
            survivors.append((idx, parsed, encoded))
        except RequestError as err:
            answers[idx] = Answer(err.status, error_body(err))
        except Exception:  # a server fault on this request alone: logged, answered 500, neighbours go on
            log.exception("request %d of the batch failed before scoring", idx)
            answers[idx] = SERVER_ERROR
    for idx, parsed, predictions in _score_survivors(survivors, scorer):
        try:
            if predictions is None:
                answers[idx] = SERVER_ERROR
            else:
                answers[idx] = Answer(200, format_predictions(predictions, parsed.is_list, model))
        except Exception:
            log.exception("request %d of the batch could not be formatted", idx)
            answers[idx] = SERVER_ERROR
    return [a if a is not None else SERVER_ERROR for a in answers]


def _score_survivors(survivors: list[tuple[int, ParsedRequest, list[Any]]],
                     scorer: Scorer) -> list[tuple[int, ParsedRequest, list[Any] | None]]:
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
            log.exception("scoring request %d alone failed", idx)
            alone.append((idx, parsed, None))
    return alone


def _scored(scorer: Scorer, encoded: Sequence[Any]) -> list[Any]:
    """The scorer's predictions for `encoded`, checked to be one per sequence."""
    predictions = list(scorer.score(encoded))
    if len(predictions) != len(encoded):
        raise RuntimeError(f"model returned {len(predictions)} predictions for {len(encoded)} texts")
    return predictions
