"""Reading a request body under the endpoint's contract (`pipeline.deployment.protocol`): the media type and content
coding its headers declare (`pipeline.deployment.media_types`), JSON decoded by orjson and checked (depth, number
size, NaN), and the texts taken from each request shape either server accepts (TorchServe's `text`/`texts`/plain
text, MLflow's four JSON formats and CSV)."""

from __future__ import annotations

import codecs
import csv
import io
import itertools
import math
from typing import Any, NamedTuple

import orjson

from pipeline.deployment.media_types import body_kind, check_content_encoding
from pipeline.deployment.protocol import (
    MAX_INT_BITS,
    MLFLOW_JSON_SHAPES,
    NON_JSON_SHAPES,
    TEXT_COLUMN,
    TORCHSERVE_SHAPES,
    Limits,
    ParsedRequest,
    RequestError,
    check_text,
    check_texts,
    json_type,
)

#: JSON values (objects, arrays, strings, numbers) a request may hold per text it may hold, plus a few for its
#: frame: the largest valid shape, `dataframe_split` with an index, holds 3 a text (its row, its text, its index)
#: and 7 more. A body that parses to more is refused before it is walked, so a megabyte of `[]` costs one parse (and
#: the collections its containers set off skip the model's objects, which the servers freeze: `freeze_loaded_objects`).
JSON_VALUES_PER_TEXT = 4
JSON_FRAME_VALUES = 16
#: Blank lines a CSV body may hold (between rows or at its end); more is a 400.
MAX_BLANK_CSV_LINES = 1024


class RawRequest(NamedTuple):
    """One request as a server hands it over: its body and the headers that say how to read it."""

    body: Any
    content_type: str | None = None
    content_encoding: str | None = None


def parse_request(body: Any, limits: Limits, content_type: str | None = None,
                  shapes: frozenset[str] = TORCHSERVE_SHAPES, content_encoding: str | None = None) -> ParsedRequest:
    """Turn one request body into texts, or raise `RequestError` (and nothing else).

    `body` is what the server hands over: bytes (the normal case: serving/config.properties turns
    TorchServe's own decoding off; MLflow's launcher passes the raw body), a str (a text body the server
    decoded) or JSON the server already decoded (dict, list or scalar). The same limits hold for each:
    already-decoded JSON is walked without recursion and its encoded size estimated. A body sent with a content
    coding (`content_encoding`, other than identity) is refused, whatever the server made of it."""
    check_content_encoding(content_encoding)
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
    # one leading UTF-8 byte-order mark, as Excel's "CSV UTF-8" and Windows tools write, is not part of the body's
    # text (RFC 8259 lets a JSON parser ignore it; a CSV header would not read "text" with it)
    raw = raw.removeprefix(codecs.BOM_UTF8)
    if not raw.strip():
        raise RequestError(400, "empty request body; send {\"text\": \"...\"} or a plain-text review"
                           if "text" in shapes else "empty request body; send {\"inputs\": [\"...\"]}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(400, f"request body is not valid UTF-8 (byte {exc.start})") from None
    if kind == "json":
        tree = _checked_tree(decode_json(raw), limits, decoded_by_server=False)
        refuse_repeated_keys(raw)
        return _from_payload(tree, limits, shapes)
    if kind == "csv":
        return ParsedRequest(check_texts(_csv_column(text, limits), limits, "row"), "csv")
    return ParsedRequest([check_text(text, "body", limits.max_chars_per_text)], "plain")


def decode_json(raw: bytes) -> Any:
    """orjson's parse: it refuses NaN/Infinity, lone surrogates, numbers beyond a double and depth over 1024."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        # orjson's message names the problem and its position; it quotes no input
        raise RequestError(400, f"invalid JSON: {exc}") from None


def refuse_repeated_keys(raw: bytes) -> None:
    """Refuse (400) a JSON body with an object that names one key twice: parsers disagree on which value counts
    (orjson and Python's json take the last, others the first), so a proxy, filter or audit log in front could read
    another review than the one scored. Call it once `_checked_tree` has accepted the body: Python's parser, which
    reports every key, recurses once per nesting level, and the tree is known to be shallow and small by then."""
    import json

    def distinct_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(pairs)
        if len(out) != len(pairs):
            raise RequestError(400, "a JSON object names the same key twice; send each key once")
        return out

    try:
        json.loads(raw, object_pairs_hook=distinct_keys)
    except RequestError:
        raise
    except (ValueError, RecursionError):  # orjson accepted it; should Python's parser not, say so, never a 500
        raise RequestError(400, "invalid JSON") from None


def _checked_tree(payload: Any, limits: Limits, decoded_by_server: bool) -> Any:
    """Refuse JSON nested deeper than `max_json_depth`, numbers outside a double's range, non-JSON types and
    (for JSON the server decoded) an encoded size above `max_body_bytes`. Iterative, so no nesting depth can
    exhaust the stack; stops at the first violation. More values than any valid request holds
    (`JSON_VALUES_PER_TEXT` a text) are 413 as soon as an object or array is seen to hold them: the walk costs
    at most that many steps whatever the body."""
    size = 0
    most = JSON_VALUES_PER_TEXT * limits.max_texts + JSON_FRAME_VALUES
    values = 1
    stack: list[tuple[Any, int]] = [(payload, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            if depth + 1 > limits.max_json_depth:
                raise RequestError(400, f"JSON nested more than {limits.max_json_depth} levels deep")
            values += len(node)
            if values > most:
                raise RequestError(413, f"JSON body holds more than {most} values; a request holds at most "
                                        f"{limits.max_texts} texts")
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
        raise RequestError(400, f"JSON body must be an object with {wanted}, got {json_type(payload)}")
    keys = [k for k in payload if k in shapes - NON_JSON_SHAPES]  # "plain" and "csv" name a media type, not a key
    if len(keys) > 1:
        quoted = " and ".join(f'"{k}"' for k in keys)
        raise RequestError(400, f"JSON body has {quoted}; send {wanted}")
    if not keys:
        raise RequestError(400, f"JSON body needs {wanted}")
    if len(payload) > 1:
        raise RequestError(400, f"JSON body has {len(payload) - 1} field(s) besides \"{keys[0]}\"; send {wanted} "
                                "and nothing else")
    shape, value = keys[0], payload[keys[0]]
    if shape == "text":
        return ParsedRequest([check_text(value, "text", limits.max_chars_per_text)], "text")
    if shape == "texts":
        return ParsedRequest(check_texts(_list(value, "texts", "a list of strings"), limits, "texts"), "texts")
    if shape == "dataframe_split":
        return ParsedRequest(check_texts(_split_column(value), limits, "data"), shape)
    if shape == "dataframe_records":
        return ParsedRequest(check_texts(_records_column(value, shape), limits, shape), shape)
    if shape in ("inputs", "instances"):
        return ParsedRequest(check_texts(_tensor_column(value, shape), limits, shape), shape)
    raise AssertionError(f"JSON shape {shape!r} has no reader")  # a shape added to protocol but not here


def _list(value: Any, where: str, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise RequestError(400, f"\"{where}\" must be {what}, got {json_type(value)}")
    return value


def _split_column(value: Any) -> list[Any]:
    """`{"columns": ["text"], "data": [[t], ...]}` (an `index` is allowed) -> the texts."""
    if not isinstance(value, dict):
        raise RequestError(400, f"\"dataframe_split\" must be an object, got {json_type(value)}")
    extra = set(value) - {"columns", "data", "index"}
    if extra:
        raise RequestError(400, f"\"dataframe_split\" has {len(extra)} field(s) besides columns, data and index")
    if value.get("columns") != [TEXT_COLUMN]:
        raise RequestError(400, f"\"dataframe_split\" needs \"columns\": [\"{TEXT_COLUMN}\"] (one column, "
                                f"\"{TEXT_COLUMN}\")")
    rows = _list(value.get("data"), "dataframe_split.data", "a list of one-item rows")
    if value.get("index") is not None:  # null: the default index, as MLflow reads it; a list: one label a row
        index = _list(value["index"], "dataframe_split.index", "a list with one label per row")
        if len(index) != len(rows):
            raise RequestError(400, f"dataframe_split.index has {len(index)} labels for {len(rows)} rows")
        if any(isinstance(label, dict | list) for label in index):
            raise RequestError(400, "dataframe_split.index labels must be strings or numbers")
    for i, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != 1:
            raise RequestError(400, f"dataframe_split.data[{i}] must be a one-item list [text], got "
                                    f"{json_type(row) if not isinstance(row, list) else f'{len(row)} items'}")
    return [row[0] for row in rows]


def _records_column(value: Any, where: str) -> list[Any]:
    """`[{"text": t}, ...]` -> the texts; a record with another column or none is refused."""
    rows = _list(value, where, f"a list of {{\"{TEXT_COLUMN}\": ...}} records")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise RequestError(400, f"{where}[{i}] must be an object {{\"{TEXT_COLUMN}\": ...}}, got "
                                    f"{json_type(row)}")
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
    """The `text` column of a CSV body with that one column and a header row; read no further than one row past
    `max_texts` (413), so a body of a million short rows costs what a valid one does."""
    # The csv module refuses a field over its limit (131,072 characters by default) before `check_text` can answer
    # a long text with 413. No field of an accepted body is longer than the body, so the limit is raised to that.
    # It is process-wide state: only ever raised, so concurrent requests never lower it under one another.
    if csv.field_size_limit() < limits.max_body_bytes:
        csv.field_size_limit(limits.max_body_bytes)
    # a blank line is no row (as Spark's CSV reader and batch scoring have it); at most `MAX_BLANK_CSV_LINES` of
    # them are skipped, so a body of a million newlines costs no more than a valid one
    blank = 0

    def counted_blank(row: list[str]) -> bool:
        nonlocal blank
        blank += not row
        if blank > MAX_BLANK_CSV_LINES:
            raise RequestError(400, f"CSV body holds more than {MAX_BLANK_CSV_LINES} blank lines")
        return not row

    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    try:
        rows = list(itertools.islice(itertools.filterfalse(counted_blank, reader), limits.max_texts + 2))
    except csv.Error as exc:
        raise RequestError(400, f"invalid CSV: {exc}") from None
    if len(rows) > limits.max_texts + 1:
        raise RequestError(413, f"CSV body holds more than {limits.max_texts} rows: texts exceed the maximum of "
                                f"{limits.max_texts} per request")
    if not rows or rows[0] != [TEXT_COLUMN]:
        raise RequestError(400, f"CSV body needs a header row with one column, \"{TEXT_COLUMN}\"")
    if len(rows) == 1:
        raise RequestError(400, f"CSV body has its header row, \"{TEXT_COLUMN}\", and no rows to score")
    for i, row in enumerate(rows[1:]):
        if len(row) != 1:
            raise RequestError(400, f"CSV row {i} has {len(row)} fields; one ({TEXT_COLUMN}) is expected")
    return [row[0] for row in rows[1:]]
