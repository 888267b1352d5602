"""The sentiment endpoint's request/response contract, defined once for both servers and independent of either.

Two servers speak it: TorchServe (`serving/handler.py`, `POST /predictions/sentiment`) and MLflow's scoring server
(`serving/mlflow_server.py`, `POST /invocations`, in front of the pyfunc `ContractPredictor`). Each takes the
request shapes its clients know (`TORCHSERVE_SHAPES`, `MLFLOW_SHAPES`); everything else is common:

- Content-Type is required: `application/json` (or `+json`), `text/plain` (one review, TorchServe) or `text/csv`
  (a `text` column, MLflow); charset UTF-8 only. Missing, form-encoded (curl's `-d` default) or anything else: 415.
- Limits (`package.*` params, carried by the archive's serving.json and the MLflow launcher): `max_body_bytes`
  (413), `max_texts` rows (413), `max_chars_per_text` per text (413), `max_json_depth` (400).
- JSON is parsed by orjson: NaN/Infinity, numbers beyond a double, lone surrogates and invalid UTF-8 are 400.
- Every text must be a string with at least one visible character once cleaned as the model reads it: null,
  numbers, objects, blank text, text made only of zero-width, bidi, control, blank filler or replacement (U+FFFD)
  characters and text that is only `<br />` markup are 400, named by where they are (`texts[3]`).
- Errors are `{"error": message, "status": code, "request_id": id}`: messages name what was wrong (type,
  position, size, limit), are at most `MAX_ERROR_CHARS` long and never quote the input. A 4xx is the caller's
  mistake; a failure of the model or the server is a 5xx (500; 503 with `Retry-After` when overloaded), logged
  with the request id, never blamed on the caller.
- Answers carry `label` and `score` per text; both servers add `X-Model-Version`, `X-Model-Variant` and
  `X-Request-Id` headers.

This module holds the contract's terms (limits, shapes, errors, answers, the checks every text passes); reading a
request body is `pipeline.deployment.request_parsing` (`parse_request`), answering a TorchServe batch with
per-request isolation `pipeline.deployment.batch_answers` (`answer_batch`).
"""

from __future__ import annotations

import math
import numbers
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol

from pipeline.data.cleaning import clean_text

# Largest integer a JSON number may hold: what still fits a double, the same bound orjson enforces on bodies
# it parses, applied to JSON the server decoded itself (Python's json turns any digit string into an int).
MAX_INT_BITS = 1024
MAX_ERROR_CHARS = 300
JSON_MEDIA_TYPES = ("application/json",)
#: Unicode categories that draw nothing: controls, format characters (zero-width, bidi marks and isolates),
#: surrogates, private use, unassigned, separators and combining marks with no base.
INVISIBLE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zs", "Zl", "Zp", "Mn", "Me"})
#: What a decoder writes for bytes it cannot read; the tokenizer drops it, so it holds no text either.
REPLACEMENT_CHARACTER = "\ufffd"
#: Characters of a drawing category that render as nothing: the Hangul fillers (letters, Lo, but Unicode's
#: Default_Ignorable_Code_Point: fonts draw them blank) and the Braille pattern with no dots. A text of only these
#: (or of them and invisible categories) holds nothing to read.
BLANK_CHARACTERS = frozenset("\u115f\u1160\u3164\uffa0\u2800")
#: Characters the tokenizer drops that this Python's Unicode database files under a drawing category: U+1734
#: HANUNOO SIGN PAMUDPOD, a spacing mark (Mc) since Unicode 14 and a nonspacing one in the tokenizer's older tables.
#: tests/serving/test_protocol.py runs every code point through the tokenizer to keep this complete.
TOKENIZER_DROPS = frozenset("\u1734")
TEXT_COLUMN = "text"
#: Decimals of the score both servers answer (a probability: a sixth decimal is below any model's noise).
SCORE_DECIMALS = 6

#: Request shapes: TorchServe's own and the four JSON formats plus CSV that MLflow's scoring server takes.
TORCHSERVE_SHAPES = frozenset({"text", "texts", "plain"})
MLFLOW_JSON_SHAPES = ("dataframe_split", "dataframe_records", "inputs", "instances")
MLFLOW_SHAPES = frozenset({*MLFLOW_JSON_SHAPES, "csv"})
#: Shapes that are a body of their own media type (text/plain, text/csv), never a key of a JSON body.
NON_JSON_SHAPES = frozenset({"plain", "csv"})
#: Response headers both servers add to every answer.
VERSION_HEADER = "X-Model-Version"
VARIANT_HEADER = "X-Model-Variant"
REQUEST_ID_HEADER = "X-Request-Id"


class RequestError(ValueError):
    """A request the endpoint rejects, with the HTTP status to answer."""

    def __init__(self, status: int, message: str) -> None:
        message = message if len(message) <= MAX_ERROR_CHARS else message[: MAX_ERROR_CHARS - 3] + "..."
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Limits:
    """Documented limits of the endpoint: `package.*` in params.yaml, carried by the archive's serving.json. No
    defaults here: the values (and their defaults) have one source, the params' `PackageParams`."""

    max_texts: int
    max_body_bytes: int
    max_chars_per_text: int
    max_json_depth: int

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Limits:
        """The limits recorded in serving.json, or params' package section (`vars(params.package)`); every one of
        them must be there: a serving.json without one was not written by the package stage."""
        names = [field.name for field in fields(cls)]
        missing = [name for name in names if config.get(name) is None]
        if missing:
            raise ValueError(f"serving limits missing: {', '.join(missing)} (the package stage records all of "
                             f"{', '.join(names)} in serving.json, from params' package section)")
        return cls(**{name: int(config[name]) for name in names})


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


def json_type(value: Any) -> str:
    """What `value` is, in JSON's words (numpy's numbers are numbers; pandas' and numpy's missing values null)."""
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    if type(value) in names:
        return names[type(value)]
    if is_missing(value):
        return "null"
    return "a number" if isinstance(value, numbers.Number) else type(value).__name__


def is_missing(value: Any) -> bool:
    """True for the ways a missing cell reaches a predictor: None, a float NaN of any width (how pandas writes a
    null in a float column), and pandas' `NA` and `NaT` (named here, so this module imports no pandas)."""
    if value is None or type(value).__name__ in ("NAType", "NaTType"):
        return True
    return isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral) and math.isnan(value)


def check_texts(values: Sequence[Any], limits: Limits, where: str) -> list[str]:
    """Every value checked by `check_text`, at least one and at most `max_texts` of them."""
    if len(values) == 0:
        raise RequestError(400, f"\"{where}\" holds no texts")
    if len(values) > limits.max_texts:
        raise RequestError(413, f"{len(values)} texts exceed the maximum of {limits.max_texts} per request")
    return [check_text(value, f"{where}[{i}]", limits.max_chars_per_text) for i, value in enumerate(values)]


def check_text(value: Any, where: str, max_chars: int | None = None) -> str:
    """`value` if it is a string holding a visible character, of at most `max_chars` characters (no length limit
    when None: the model itself cuts long texts); else `RequestError`."""
    if not isinstance(value, str):
        raise RequestError(400, f"{where} must be a string, got {json_type(value)}")
    if max_chars is not None and len(value) > max_chars:
        raise RequestError(413, f"{where} has {len(value)} characters, more than the limit of {max_chars}")
    if not value.strip():
        raise RequestError(400, f"{where} is empty or whitespace only")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:  # JSON decoded by the server may hold "\ud800"; no tokenizer takes it
        raise RequestError(400, f"{where} holds a lone UTF-16 surrogate at character {exc.start}") from None
    if not has_visible(value):
        raise RequestError(400, f"{where} holds no visible character (only zero-width, bidi, control, combining, "
                                "blank filler or replacement characters)")
    if "<" in value and not has_visible(clean_text(value)):  # what the model reads: `<br />` markup dropped
        raise RequestError(400, f"{where} holds nothing but line-break markup (<br />): no text to score")
    return value


def has_visible(text: str) -> bool:
    """True when `text` holds a character that draws something and that the tokenizer keeps: U+FFFD, which
    decoding writes for bytes that are not UTF-8 and BERT's tokenizers drop, counts as invisible."""
    return any(ch != REPLACEMENT_CHARACTER and ch not in BLANK_CHARACTERS and ch not in TOKENIZER_DROPS
               and unicodedata.category(ch) not in INVISIBLE_CATEGORIES for ch in text)


def format_predictions(predictions: Sequence[Any], is_list: bool, model: str) -> Any:
    """`{"label", "score", "model"}` per text; a list when the request sent a list."""
    items = [{"label": p.label, "score": rounded_score(p.score), "model": model} for p in predictions]
    return items if is_list else items[0]


def rounded_score(score: float) -> float:
    """A probability as both servers answer it: `SCORE_DECIMALS` decimals."""
    return round(float(score), SCORE_DECIMALS)


def error_body(err: RequestError) -> dict[str, Any]:
    """The JSON error answered with a 4xx status."""
    return {"error": err.message, "status": err.status}


def server_error(request_id: str | None = None) -> Answer:
    """The 500 for a request the server failed on, the same body on both servers (a new answer each time: its body
    is the caller's to extend)."""
    body: dict[str, Any] = {"error": "internal error while answering this request (logged on the server with its "
                                     "request id)", "status": 500}
    return Answer(500, {**body, "request_id": request_id} if request_id is not None else body)


