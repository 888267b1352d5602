"""The sentiment endpoint's request/response contract, independent of TorchServe.

Accepted bodies: JSON `{"text": "..."}`, JSON `{"texts": ["...", ...]}` (at most `max_texts`), or a
plain-text body holding one review. Every malformed request maps to a `RequestError` with an HTTP 4xx
status and a message; nothing in a request is ever evaluated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


class RequestError(ValueError):
    """A request the endpoint rejects, with the HTTP status to answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Limits:
    """Documented limits of the endpoint."""

    max_texts: int = 64
    max_body_bytes: int = 1_000_000


@dataclass(frozen=True)
class ParsedRequest:
    """Texts to score, and whether the caller sent a list (answered with a list)."""

    texts: list[str]
    is_list: bool


def _as_bytes(body: Any) -> bytes | None:
    if body is None:
        return None
    if isinstance(body, bytes | bytearray):
        return bytes(body)
    if isinstance(body, str):
        return body.encode("utf-8")
    return None


def parse_request(body: Any, limits: Limits) -> ParsedRequest:
    """Turn one request body (bytes, str, or JSON already decoded by the server) into texts."""
    if isinstance(body, dict | list):
        payload: Any = body  # TorchServe decodes application/json bodies itself
    else:
        raw = _as_bytes(body)
        if raw is None or not raw.strip():
            raise RequestError(400, "empty request body; send {\"text\": \"...\"} or a plain-text review")
        if len(raw) > limits.max_body_bytes:
            raise RequestError(413, f"request body of {len(raw)} bytes exceeds the limit of {limits.max_body_bytes}")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RequestError(400, f"request body is not valid UTF-8 (byte {exc.start})") from None
        stripped = text.lstrip()
        if stripped.startswith(("{", "[")):
            try:
                payload = json.loads(text)
            except json.JSONDecodeError as exc:
                raise RequestError(400, f"invalid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
        else:
            return ParsedRequest([_check_text(text, "body")], is_list=False)
    if not isinstance(payload, dict):
        raise RequestError(400, "JSON body must be an object with \"text\" or \"texts\"")
    if "texts" in payload:
        texts = payload["texts"]
        if not isinstance(texts, list):
            raise RequestError(400, "\"texts\" must be a list of strings")
        if not texts:
            raise RequestError(400, "\"texts\" is empty")
        if len(texts) > limits.max_texts:
            raise RequestError(413, f"{len(texts)} texts exceed the maximum of {limits.max_texts} per request")
        return ParsedRequest([_check_text(t, f"texts[{i}]") for i, t in enumerate(texts)], is_list=True)
    if "text" in payload:
        return ParsedRequest([_check_text(payload["text"], "text")], is_list=False)
    raise RequestError(400, "JSON body needs a \"text\" string or a \"texts\" list")


def _check_text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise RequestError(400, f"{where} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise RequestError(400, f"{where} is empty or whitespace only")
    return value


def format_predictions(predictions: list[Any], is_list: bool, model: str) -> Any:
    """`{"label", "score", "model"}` per text; a list when the request sent a list."""
    items = [{"label": p.label, "score": round(float(p.score), 6), "model": model} for p in predictions]
    return items if is_list else items[0]


def error_body(err: RequestError) -> dict[str, Any]:
    """The JSON error answered with a 4xx status."""
    return {"error": err.message, "status": err.status}
