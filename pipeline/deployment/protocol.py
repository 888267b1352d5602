"""The sentiment endpoint's request/response contract, defined once for both servers and independent of either.

Two servers speak it: TorchServe (`serving/handler.py`, `POST /predictions/sentiment`) and MLflow's scoring server
(`serving/mlflow_server.py`, `POST /invocations`, in front of the pyfunc `ContractPredictor`). Each takes the
request shapes its clients know (`TORCHSERVE_SHAPES`, `MLFLOW_SHAPES`); everything else is common:

- Content-Type is required: `application/json` (or `+json`), `text/plain` (one review, TorchServe) or `text/csv`
  (a `text` column, MLflow); charset UTF-8 only. Missing, form-encoded (curl's `-d` default) or anything else: 415.
- Limits (`package.*` params, carried by the archive's serving.json and the MLflow launcher): `max_body_bytes`
  (413), `max_texts` rows (413), `max_chars_per_text` per text (413), `max_json_depth` (400).
- JSON is parsed by orjson: NaN/Infinity, numbers beyond a double, lone surrogates and invalid UTF-8 are 400.
- Every text must be a string with at least one visible character: null, numbers, objects, blank text and text
  made only of zero-width, bidi or control characters are 400, named by where they are (`texts[3]`).
- Errors are `{"error": message, "status": code}`: messages name what was wrong (type, position, size, limit),
  are at most `MAX_ERROR_CHARS` long and never quote the input.
- Answers carry `label` and `score` per text; both servers add `X-Model-Version` and `X-Model-Variant` headers.

`answer_batch` answers a TorchServe batch with per-request isolation: each request is parsed, checked and
tokenized on its own, whatever goes wrong with one becomes that request's own answer (4xx when the input is
at fault, 500 when the server is), and only the survivors are scored, together, or one by one when the
batched forward pass fails.
"""

from __future__ import annotations

import csv
import io
import logging
import math
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

log = logging.getLogger(__name__)

# Largest integer a JSON number may hold: what still fits a double, the same bound orjson enforces on bodies
# it parses, applied to JSON the server decoded itself (Python's json turns any digit string into an int).
MAX_INT_BITS = 1024
MAX_ERROR_CHARS = 300
JSON_MEDIA_TYPES = ("application/json",)
#: Unicode categories that draw nothing: controls, format characters (zero-width, bidi marks and isolates),
#: surrogates, private use, unassigned, separators and combining marks with no base.
INVISIBLE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zs", "Zl", "Zp", "Mn", "Me"})
TEXT_COLUMN = "text"

#: Request shapes: TorchServe's own and the four JSON formats plus CSV that MLflow's scoring server takes.
TORCHSERVE_SHAPES = frozenset({"text", "texts", "plain"})
MLFLOW_JSON_SHAPES = ("dataframe_split", "dataframe_records", "inputs", "instances")
MLFLOW_SHAPES = frozenset({*MLFLOW_JSON_SHAPES, "csv"})
#: Response headers both servers add to every answer.
VERSION_HEADER = "X-Model-Version"
VARIANT_HEADER = "X-Model-Variant"


class RequestError(ValueError):
    """A request the endpoint rejects, with the HTTP status to answer."""

    def __init__(self, status: int, message: str) -> None:
        message = message if len(message) <= MAX_ERROR_CHARS else message[: MAX_ERROR_CHARS - 3] + "..."
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Limits:
    """Documented limits of the endpoint (`package.*` in params.yaml, carried by the archive's serving.json)."""

    max_texts: int = 64
    max_body_bytes: int = 1_000_000
    max_chars_per_text: int = 20_000
    max_json_depth: int = 8

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Limits:
        """The limits recorded in serving.json (or params' package section); missing keys keep their defaults."""
        names = ("max_texts", "max_body_bytes", "max_chars_per_text", "max_json_depth")
        return cls(**{name: int(config[name]) for name in names if config.get(name) is not None})


@dataclass(frozen=True)
class ParsedRequest:
    """Texts to score and the shape they came in (`text` and a plain-text body are answered with one object, the
    others with a list)."""

    texts: list[str]
    shape: str

    @property
    def is_list(self) -> bool:
        return self.shape not in ("text", "plain")


@dataclass(frozen=True)
class Answer:
    """One request's answer: the HTTP status and the JSON-serialisable body."""

    status: int
    body: Any


class Scorer(Protocol):
    """What `answer_batch` needs of the model: tokenize one request's texts, score token ids in one batch."""

    def encode(self, texts: Sequence[str]) -> list[Any]: ...

    def score(self, encoded: Sequence[Any]) -> list[Any]: ...


def media_type(content_type: str | None) -> tuple[str, dict[str, str]]:
    """`(type, parameters)` of a Content-Type header, lower-cased; `("", {})` when absent or blank."""
    if not content_type or not content_type.strip():
        return "", {}
    media, *params = content_type.split(";")
    parsed = {}
    for param in params:
        key, _, value = param.partition("=")
        parsed[key.strip().lower()] = value.strip().strip('"').lower()
    return media.strip().lower(), parsed


def is_json_media_type(content_type: str | None) -> bool:
    """`application/json` or a `+json` suffix type, parameters (charset) ignored."""
    media, _ = media_type(content_type)
    return media in JSON_MEDIA_TYPES or media.endswith("+json")


def body_kind(content_type: str | None, shapes: frozenset[str]) -> str:
    """`json`, `plain` or `csv` for a declared Content-Type this endpoint takes; else `RequestError(415)`."""
    media, params = media_type(content_type)
    accepted = ["application/json"] + (["text/plain"] if "plain" in shapes else []) + \
        (["text/csv"] if "csv" in shapes else [])
    if not media:
        raise RequestError(415, f"no Content-Type header; send one of {', '.join(accepted)}")
    if media == "application/x-www-form-urlencoded" or media.startswith("multipart/"):
        raise RequestError(415, f"a form-encoded body ({media}) is not accepted: send the JSON itself with "
                                "'Content-Type: application/json' (curl -d sends form encoding unless told -H)")
    charset = params.get("charset", "utf-8")
    if charset not in ("utf-8", "utf8"):
        raise RequestError(415, "only charset=utf-8 is accepted")
    if set(params) - {"charset"}:
        raise RequestError(415, "Content-Type parameters other than charset are not accepted")
    if media in JSON_MEDIA_TYPES or media.endswith("+json"):
        return "json"
    if media == "text/plain" and "plain" in shapes:
        return "plain"
    if media == "text/csv" and "csv" in shapes:
        return "csv"
    shown = media if len(media) <= 60 and media.isascii() and media.isprintable() else "this media type"
    raise RequestError(415, f"Content-Type {shown} is not accepted; send one of {', '.join(accepted)}")


def parse_request(body: Any, limits: Limits, content_type: str | None = None,
                  shapes: frozenset[str] = TORCHSERVE_SHAPES) -> ParsedRequest:
    """Turn one request body into texts, or raise `RequestError` (and nothing else).

    `body` is what the server hands over: bytes (the normal case: serving/config.properties turns
    TorchServe's own decoding off; MLflow's launcher passes the raw body), a str (a text body the server
    decoded) or JSON the server already decoded (dict, list or scalar). The same limits hold for each:
    already-decoded JSON is walked without recursion and its encoded size estimated."""
    if isinstance(body, bytes | bytearray | memoryview):
        raw = bytes(body)
    elif isinstance(body, str):
        raw = body.encode("utf-8", "surrogatepass")  # the size the client sent; surrogates are refused below
    elif body is None:
        raw = b""
    else:
        return _from_payload(_checked_tree(body, limits, decoded_by_server=True), limits, shapes)
    if len(raw) > limits.max_body_bytes:
        raise RequestError(413, f"request body of {len(raw)} bytes exceeds the limit of {limits.max_body_bytes}")
    kind = body_kind(content_type, shapes)
    if not raw.strip():
        raise RequestError(400, "empty request body; send {\"text\": \"...\"} or a plain-text review"
                           if "text" in shapes else "empty request body; send {\"inputs\": [\"...\"]}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(400, f"request body is not valid UTF-8 (byte {exc.start})") from None
    if kind == "json":
        return _from_payload(_checked_tree(decode_json(raw), limits, decoded_by_server=False), limits, shapes)
    if kind == "csv":
        return ParsedRequest(check_texts(_csv_column(text, limits), limits, "row"), "csv")
    return ParsedRequest([check_text(text, "body", limits)], "plain")


def decode_json(raw: bytes) -> Any:
    """orjson's parse: it refuses NaN/Infinity, lone surrogates, numbers beyond a double and depth over 1024."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        # orjson's message names the problem and its position; it quotes no input
        raise RequestError(400, f"invalid JSON: {exc}") from None


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


def _from_payload(payload: Any, limits: Limits, shapes: frozenset[str]) -> ParsedRequest:
    mlflow = not {"text", "texts"} & shapes
    wanted = ("exactly one of " + ", ".join(f'"{k}"' for k in MLFLOW_JSON_SHAPES) if mlflow
              else 'a "text" string or a "texts" list')
    if not isinstance(payload, dict):
        raise RequestError(400, f"JSON body must be an object with {wanted}, got {_json_type(payload)}")
    keys = [k for k in payload if k in shapes]
    if len(keys) > 1:
        raise RequestError(400, f"JSON body has {' and '.join(f'{chr(34)}{k}{chr(34)}' for k in keys)}; "
                                f"send {wanted}")
    if not keys:
        raise RequestError(400, f"JSON body needs {wanted}")
    if len(payload) > 1:
        raise RequestError(400, f"JSON body has {len(payload) - 1} field(s) besides \"{keys[0]}\"; send {wanted} "
                                "and nothing else")
    shape, value = keys[0], payload[keys[0]]
    if shape == "text":
        return ParsedRequest([check_text(value, "text", limits)], "text")
    if shape == "texts":
        return ParsedRequest(check_texts(_list(value, "texts", "a list of strings"), limits, "texts"), "texts")
    if shape == "dataframe_split":
        return ParsedRequest(check_texts(_split_column(value), limits, "data"), shape)
    if shape == "dataframe_records":
        return ParsedRequest(check_texts(_records_column(value, shape), limits, shape), shape)
    return ParsedRequest(check_texts(_tensor_column(value, shape), limits, shape), shape)


def _list(value: Any, where: str, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise RequestError(400, f"\"{where}\" must be {what}, got {_json_type(value)}")
    return value


def _split_column(value: Any) -> list[Any]:
    """`{"columns": ["text"], "data": [[t], ...]}` (an `index` is allowed) -> the texts."""
    if not isinstance(value, dict):
        raise RequestError(400, f"\"dataframe_split\" must be an object, got {_json_type(value)}")
    extra = set(value) - {"columns", "data", "index"}
    if extra:
        raise RequestError(400, f"\"dataframe_split\" has {len(extra)} field(s) besides columns, data and index")
    if value.get("columns") != [TEXT_COLUMN]:
        raise RequestError(400, f"\"dataframe_split\" needs \"columns\": [\"{TEXT_COLUMN}\"] (one column, "
                                f"\"{TEXT_COLUMN}\")")
    rows = _list(value.get("data"), "dataframe_split.data", "a list of one-item rows")
    for i, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != 1:
            raise RequestError(400, f"dataframe_split.data[{i}] must be a one-item list [text], got "
                                    f"{_json_type(row) if not isinstance(row, list) else f'{len(row)} items'}")
    return [row[0] for row in rows]


def _records_column(value: Any, where: str) -> list[Any]:
    """`[{"text": t}, ...]` -> the texts; a record with another column or none is refused."""
    rows = _list(value, where, f"a list of {{\"{TEXT_COLUMN}\": ...}} records")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise RequestError(400, f"{where}[{i}] must be an object {{\"{TEXT_COLUMN}\": ...}}, got "
                                    f"{_json_type(row)}")
        if list(row) != [TEXT_COLUMN]:
            raise RequestError(400, f"{where}[{i}] must have exactly one column, \"{TEXT_COLUMN}\" (it has "
                                    f"{len(row)} column(s){'' if TEXT_COLUMN in row else ', none of them text'})")
    return [row[TEXT_COLUMN] for row in rows]


def _tensor_column(value: Any, where: str) -> list[Any]:
    """`inputs`/`instances`: `["t", ...]`, `{"text": ["t", ...]}` or `[{"text": "t"}, ...]` -> the texts."""
    if isinstance(value, dict):
        if list(value) != [TEXT_COLUMN]:
            raise RequestError(400, f"\"{where}\" as an object must have exactly one column, \"{TEXT_COLUMN}\"")
        return _list(value[TEXT_COLUMN], f"{where}.{TEXT_COLUMN}", "a list of strings")
    rows = _list(value, where, "a list of strings")
    if rows and all(isinstance(row, dict) for row in rows):
        return _records_column(rows, where)
    return rows


def _csv_column(text: str, limits: Limits) -> list[str]:
    """The `text` column of a CSV body with that one column and a header row."""
    try:
        rows = list(csv.reader(io.StringIO(text, newline=""), strict=True))
    except csv.Error as exc:
        raise RequestError(400, f"invalid CSV: {exc}") from None
    if not rows or rows[0] != [TEXT_COLUMN]:
        raise RequestError(400, f"CSV body needs a header row with one column, \"{TEXT_COLUMN}\"")
    for i, row in enumerate(rows[1:]):
        if len(row) != 1:
            raise RequestError(400, f"CSV row {i} has {len(row)} fields; one ({TEXT_COLUMN}) is expected")
    return [row[0] for row in rows[1:]]


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number" if isinstance(value, int | float) else type(value).__name__)


def check_texts(values: Sequence[Any], limits: Limits, where: str) -> list[str]:
    """Every value checked by `check_text`, at least one and at most `max_texts` of them."""
    if len(values) == 0:
        raise RequestError(400, f"\"{where}\" holds no texts")
    if len(values) > limits.max_texts:
        raise RequestError(413, f"{len(values)} texts exceed the maximum of {limits.max_texts} per request")
    return [check_text(value, f"{where}[{i}]", limits) for i, value in enumerate(values)]


def check_text(value: Any, where: str, limits: Limits) -> str:
    """`value` if it is a string holding a visible character, within `max_chars_per_text`; else `RequestError`."""
    if not isinstance(value, str):
        if isinstance(value, float) and math.isnan(value):  # how pandas writes a missing cell (null, empty)
            raise RequestError(400, f"{where} must be a string, got null")
        raise RequestError(400, f"{where} must be a string, got {_json_type(value)}")
    if len(value) > limits.max_chars_per_text:
        raise RequestError(413, f"{where} has {len(value)} characters, more than the limit of "
                                f"{limits.max_chars_per_text}")
    if not value.strip():
        raise RequestError(400, f"{where} is empty or whitespace only")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:  # JSON decoded by the server may hold "\ud800"; no tokenizer takes it
        raise RequestError(400, f"{where} holds a lone UTF-16 surrogate at character {exc.start}") from None
    if all(unicodedata.category(ch) in INVISIBLE_CATEGORIES for ch in value):
        raise RequestError(400, f"{where} holds no visible character (only zero-width, bidi, control or "
                                "combining characters)")
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
