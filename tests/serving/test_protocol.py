"""The request contract and per-request isolation in-process (`pipeline.deployment.protocol`, `serving.handler` without
TorchServe): property-based over arbitrary bytes, arbitrary JSON values (as bytes and as JSON the server
decoded itself) and mixes of valid and hostile requests, plus the poison payloads that once failed a batch."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.data.cleaning import clean_text
from pipeline.deployment.batch_answers import answer_batch
from pipeline.deployment.inference import SentimentPredictor
from pipeline.deployment.media_types import is_json_media_type
from pipeline.deployment.protocol import (
    MAX_ERROR_CHARS,
    MLFLOW_SHAPES,
    NON_JSON_SHAPES,
    TORCHSERVE_SHAPES,
    Limits,
    RequestError,
    check_text,
    has_visible,
)
from pipeline.deployment.request_parsing import RawRequest, parse_request
from serving.handler import SentimentHandler
from tests import factories

LIMITS = Limits(max_texts=4, max_body_bytes=4096, max_chars_per_text=256, max_json_depth=8)
CONTENT_TYPES = [None, "application/json", "application/json; charset=utf-8", "text/plain",
                 "application/octet-stream", "application/x-www-form-urlencoded"]
FEW = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def nested(depth: int, inner: object = "x") -> object:
    """`depth` lists around `inner`, built without recursion."""
    value = inner
    for _ in range(depth):
        value = [value]
    return value


# The inputs that once made the handler raise and TorchServe answer 503 to a whole batch (issue 17).
POISON: list[tuple[object, str | None]] = [
    (b"[" * 1200 + b"]" * 1200, "application/json"),
    (b'{"text": ' + b"1" * 5000 + b"}", "application/json"),
    (b'{"text": "bad \\ud800 surrogate"}', "application/json"),
    ({"text": "bad \ud800 surrogate"}, "application/json"),  # as TorchServe's own JSON decoding hands it over
    ({"text": 10**5000}, "application/json"),
    (nested(1200), "application/json"),
    (True, "application/json"),
    (7, "application/json"),
    (b"true", "application/json"),
    (b"NaN", "application/json"),
    ({"text": float("nan")}, "application/json"),
    ({"text": "x" * 8000}, "application/json"),  # decoded JSON larger than max_body_bytes
    (bytearray(b'{"texts": ["' + b"y" * 5000 + b'"]}'), "application/json"),
]


@pytest.mark.parametrize(("body", "content_type"), POISON, ids=range(len(POISON)))
def test_each_poison_payload_is_a_request_error_with_a_reason(body, content_type):
    with pytest.raises(RequestError) as err:
        parse_request(body, LIMITS, content_type)
    assert 400 <= err.value.status < 500 and len(err.value.message) > 10
    assert "empty" not in err.value.message  # a JSON true or number is not an empty body


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        (b"[" * 1200 + b"]" * 1200, 400, "depth"),
        (json.dumps(nested(9)).encode(), 400, "more than 8 levels"),
        (nested(9), 400, "more than 8 levels"),
        (b'{"text": ' + b"1" * 1000 + b"}", 400, "number is infinity"),
        ({"text": 10**5000}, 400, "number too large"),
        ({"text": "bad \ud800 surrogate"}, 400, "lone UTF-16 surrogate at character 4"),
        (True, 400, "got a boolean"),
        (7, 400, "got a number"),
        ({"text": "x" * 8000}, 413, "exceeds the limit of 4096"),
        ({"texts": ["a"] * 5}, 413, "maximum of 4"),
        (b"x" * 5000, 413, "5000 bytes exceeds the limit of 4096"),
    ],
)
def test_messages_say_what_was_wrong(body, status, needle):
    with pytest.raises(RequestError) as err:
        parse_request(body, LIMITS, "application/json")
    assert err.value.status == status and needle in err.value.message, err.value.message


def test_valid_bodies_in_every_form():
    json_type = "application/json"
    assert parse_request(b'{"text": "good"}', LIMITS, json_type).texts == ["good"]
    assert parse_request(bytearray(b'{"texts": ["a", "b"]}'), LIMITS, json_type).is_list
    assert parse_request({"texts": ["a", "b"]}, LIMITS).texts == ["a", "b"]  # JSON the server decoded
    assert parse_request("a plain review", LIMITS, "text/plain").texts == ["a plain review"]
    assert parse_request(b"true", LIMITS, "text/plain").texts == ["true"]  # a plain-text review saying "true"
    within_depth = {"texts": [nested(6, "ok")[0]]}  # 8 levels: the object, the list and 6 lists
    with pytest.raises(RequestError, match="must be a string"):  # within the depth, but no string where one goes
        parse_request(json.dumps(within_depth).encode(), LIMITS, json_type)
    rows = ["a", 'b, "quoted"\nline']
    mlflow = {"dataframe_split": {"columns": ["text"], "data": [[t] for t in rows]},
              "dataframe_records": [{"text": t} for t in rows], "inputs": rows, "instances": {"text": rows}}
    for key, value in mlflow.items():
        parsed = parse_request(json.dumps({key: value}).encode(), LIMITS, json_type, MLFLOW_SHAPES)
        assert parsed.texts == rows and parsed.shape == key
    csv_body = b'text\na\n"b, ""quoted""\nline"\n'
    assert parse_request(csv_body, LIMITS, "text/csv", MLFLOW_SHAPES).texts == rows
    for index in ("null", '["r1", 2]'):  # null is the default index, as MLflow's own parser reads it
        body = b'{"dataframe_split": {"columns": ["text"], "data": [["a"], ["b"]], "index": %s}}' % index.encode()
        assert parse_request(body, LIMITS, json_type, MLFLOW_SHAPES).texts == ["a", "b"]


@pytest.mark.parametrize(
    ("body", "content_type", "shapes", "status", "needle"),
    [
        (b'{"text": "a"}', None, TORCHSERVE_SHAPES, 415, "no Content-Type"),
        (b'{"text": "a"}', "application/x-www-form-urlencoded", TORCHSERVE_SHAPES, 415, "form-encoded"),
        (b'{"text": "a"}', "application/json; charset=latin-1", TORCHSERVE_SHAPES, 415, "charset"),
        (b"text\na\n", "text/csv", TORCHSERVE_SHAPES, 415, "not accepted"),
        (b"a review", "text/plain", MLFLOW_SHAPES, 415, "not accepted"),
        (b'{"text": "a", "texts": ["b"]}', "application/json", TORCHSERVE_SHAPES, 400, '"text" and "texts"'),
        (b'{"text": "a", "extra": 1}', "application/json", TORCHSERVE_SHAPES, 400, "besides"),
        (rb'{"text": "\u200b\u202e\u0007"}', "application/json", TORCHSERVE_SHAPES, 400, "no visible character"),
        (json.dumps({"text": "x" * 257}).encode(), "application/json", TORCHSERVE_SHAPES, 413, "257 characters"),
        (b'{"inputs": ["a"], "instances": ["b"]}', "application/json", MLFLOW_SHAPES, 400, "and"),
        (b'{"dataframe_records": [{"review": "a"}]}', "application/json", MLFLOW_SHAPES, 400, "exactly one column"),
        (b'{"dataframe_split": {"columns": ["x"], "data": [["a"]]}}', "application/json", MLFLOW_SHAPES, 400,
         '"columns": ["text"]'),
        (b'{"dataframe_records": [{"text": null}]}', "application/json", MLFLOW_SHAPES, 400, "got null"),
        (b'{"inputs": [5]}', "application/json", MLFLOW_SHAPES, 400, "inputs[0] must be a string, got a number"),
        (b'{"inputs": []}', "application/json", MLFLOW_SHAPES, 400, "no texts"),
        (b"review\na\n", "text/csv", MLFLOW_SHAPES, 400, "header row"),
        (b'text\n"a",b\n', "text/csv", MLFLOW_SHAPES, 400, "2 fields"),
        (b"text\n" + b"a\n" * 5, "text/csv", MLFLOW_SHAPES, 413, "maximum of 4"),
        (b"text\na\n", "text/csv; header=absent", MLFLOW_SHAPES, 415, "other than header=present"),
        (b'{"text": "a"}', "application/json; q=1", TORCHSERVE_SHAPES, 415, "other than charset"),
        (b'{"text": "a"}', "; charset=utf-8", TORCHSERVE_SHAPES, 415, "a Content-Type with no media type"),
        (b"text\n", "text/csv", MLFLOW_SHAPES, 400, "no rows to score"),
        (b"text\n\n\n", "text/csv", MLFLOW_SHAPES, 400, "no rows to score"),
        (b"text\n" + b"\n" * 1025 + b"a\n", "text/csv", MLFLOW_SHAPES, 400, "more than 1024 blank lines"),
        ('{"text": "\u3164\u115f\u2800 \u200b"}'.encode(), "application/json", TORCHSERVE_SHAPES, 400,
         "no visible character"),
        (b'{"dataframe_split": {"columns": ["text"], "data": [["a"]], "index": [0, 1, 2]}}', "application/json",
         MLFLOW_SHAPES, 400, "3 labels for 1 rows"),
        (b'{"dataframe_split": {"columns": ["text"], "data": [["a"]], "index": "0"}}', "application/json",
         MLFLOW_SHAPES, 400, "\"dataframe_split.index\" must be a list"),
        (b'{"dataframe_split": {"columns": ["text"], "data": [["a"]], "index": [{}]}}', "application/json",
         MLFLOW_SHAPES, 400, "strings or numbers"),
    ],
)
def test_the_contracts_refusals_name_the_problem(body, content_type, shapes, status, needle):
    with pytest.raises(RequestError) as err:
        parse_request(body, LIMITS, content_type, shapes)
    assert err.value.status == status and needle in err.value.message, err.value.message


@pytest.mark.parametrize("shapes", [TORCHSERVE_SHAPES, MLFLOW_SHAPES])
@pytest.mark.parametrize("content_type", ["text/csv; header=PLANTED", "application/json; PLANTED=1; PLANTED=2",
                                          "text/csv; header=present; header=PLANTED"])
def test_a_content_type_refusal_never_quotes_the_clients_parameters(shapes, content_type):
    """A refused Content-Type's parameter names and values are the client's text: the 415 says what is wrong
    without them (before, a `header=` value and a repeated parameter's name came back in the error)."""
    with pytest.raises(RequestError) as err:
        parse_request(b"text\na\n", LIMITS, content_type, shapes)
    assert err.value.status == 415 and "PLANTED" not in err.value.message, err.value.message


@pytest.mark.parametrize("shapes", [TORCHSERVE_SHAPES, MLFLOW_SHAPES])
@pytest.mark.parametrize("key", sorted(NON_JSON_SHAPES))
def test_a_media_type_shape_is_not_a_json_key(shapes, key):
    """"plain" and "csv" name bodies of their own media type: as the key of a JSON body they are refused, never read
    as a list whose answer would then be one object for several texts."""
    for value in (["good", "bad", "ugly"], "good", {"text": ["good"]}):
        with pytest.raises(RequestError) as err:
            parse_request(json.dumps({key: value}).encode(), LIMITS, "application/json", shapes)
        assert err.value.status == 400 and "needs" in err.value.message, err.value.message


@pytest.mark.parametrize(("body", "content_type", "shapes"), [
    (b'{"text": "good film"}', "application/json", TORCHSERVE_SHAPES),
    (b'{"inputs": ["good film"]}', "application/json", MLFLOW_SHAPES),
    (b"text\r\ngood film\r\n", "text/csv", MLFLOW_SHAPES),
    (b"good film", "text/plain", TORCHSERVE_SHAPES)])
@pytest.mark.parametrize("as_str", [False, True])
def test_a_leading_byte_order_mark_is_not_part_of_the_body(body, content_type, shapes, as_str):
    """Excel's "CSV UTF-8" and Windows tools start a body with a UTF-8 byte-order mark: every body kind reads the
    same with it as without (one mark; a second is text), whether the server hands bytes or decoded text."""
    marked = b"\xef\xbb\xbf" + body
    plain = parse_request(body, LIMITS, content_type, shapes)
    with_mark = parse_request(marked.decode("utf-8") if as_str else marked, LIMITS, content_type, shapes)
    assert with_mark.texts == plain.texts == ["good film"]
    with pytest.raises(RequestError, match="empty"):
        parse_request(b"\xef\xbb\xbf  ", LIMITS, content_type, shapes)


def test_content_type_parameters_the_rfcs_allow():
    """An empty parameter (`application/json;`, RFC 9110) and text/csv's `header=present` (RFC 4180) are accepted."""
    assert parse_request(b'{"text": "a"}', LIMITS, "application/json;").texts == ["a"]
    assert parse_request(b'{"text": "a"}', LIMITS, "application/json; ; charset=utf-8").texts == ["a"]
    assert parse_request(b"text\na\n", LIMITS, "text/csv; header=present", MLFLOW_SHAPES).texts == ["a"]


def test_a_csv_text_longer_than_the_csv_modules_field_limit_is_a_413_for_its_length():
    """The csv module's own field limit (131,072 characters by default) must not answer first with a 400."""
    limits = factories.limits(max_body_bytes=400_000, max_chars_per_text=1_000)
    body = b"text\n" + b"x" * 200_000 + b"\n"
    with pytest.raises(RequestError) as err:
        parse_request(body, limits, "text/csv", MLFLOW_SHAPES)
    assert err.value.status == 413 and "characters" in err.value.message, err.value.message


def test_the_largest_valid_request_of_each_shape_is_within_the_value_cap():
    """The cap on JSON values (`JSON_VALUES_PER_TEXT` a text) refuses no valid request: each shape at
    `max_texts` texts, `dataframe_split` with its index, parses."""
    rows = [f"review {i}" for i in range(LIMITS.max_texts)]
    limits = factories.limits(max_texts=LIMITS.max_texts, max_body_bytes=100_000)
    bodies = [{"dataframe_split": {"columns": ["text"], "data": [[t] for t in rows],
                                   "index": list(range(len(rows)))}},
              {"dataframe_records": [{"text": t} for t in rows]}, {"inputs": {"text": rows}},
              {"instances": [{"text": t} for t in rows]}]
    for body in bodies:
        for raw in (json.dumps(body).encode(), body):  # as bytes and as JSON the server decoded
            assert parse_request(raw, limits, "application/json", MLFLOW_SHAPES).texts == rows
    assert parse_request({"texts": rows}, limits, "application/json").texts == rows


@pytest.mark.parametrize("as_bytes", [True, False])
def test_a_body_of_more_values_than_any_request_holds_is_refused_before_it_is_walked(as_bytes):
    """A megabyte of empty arrays, or an object of a hundred thousand keys, is a 413 from the first container's
    length, not after a walk over every value (which blocked the MLflow server's event loop for most of a second
    per request)."""
    limits = factories.limits(max_texts=64, max_body_bytes=2_000_000)
    for payload in ({"inputs": [[] for _ in range(300_000)]}, {"inputs": {f"k{i}": 1 for i in range(100_000)}}):
        body = json.dumps(payload).encode() if as_bytes else payload
        with pytest.raises(RequestError) as err:
            parse_request(body, limits, "application/json", MLFLOW_SHAPES)
        assert err.value.status == 413 and "values" in err.value.message


@pytest.mark.parametrize("newline", [b"\n", b"\r\n"])
def test_a_blank_csv_line_is_no_row(newline):
    """As Spark's CSV reader (batch scoring) has it: blank lines between rows and at the end are skipped, and do not
    count towards `max_texts`; a line of spaces is a row (a blank text, refused)."""
    rows = [b"text", b"a good film", b"", b"a bad film", b"", b""]
    parsed = parse_request(newline.join(rows) + newline, LIMITS, "text/csv", MLFLOW_SHAPES)
    assert parsed.texts == ["a good film", "a bad film"]
    four = newline.join([b"text"] + [b"", b"x"] * 4 + [b""] * 3)
    assert parse_request(four, LIMITS, "text/csv", MLFLOW_SHAPES).texts == ["x"] * 4  # LIMITS.max_texts
    with pytest.raises(RequestError, match=r"row\[1\] is empty or whitespace only"):
        parse_request(newline.join([b"text", b"a", b"  "]), LIMITS, "text/csv", MLFLOW_SHAPES)


@pytest.mark.parametrize(("encoding", "needle"), [("gzip", "(gzip)"), ("br", "(br)"), ("GZIP, identity", "(gzip)"),
                                                  ("x-secret-coding", "(this Content-Encoding)")])
def test_a_body_with_a_content_coding_is_refused_never_read_as_text(encoding, needle):
    """Neither server decompresses: a compressed body is a 415 that says so (not "not valid UTF-8"), and a plain one
    labelled compressed is not scored as if the label were not there; `identity` is no coding at all."""
    import gzip

    body = b'{"text": "a wonderful film"}'
    for sent in (body, gzip.compress(body)):
        with pytest.raises(RequestError) as err:
            parse_request(sent, LIMITS, "application/json", content_encoding=encoding)
        assert err.value.status == 415 and needle in err.value.message and "secret" not in err.value.message
    assert parse_request(body, LIMITS, "application/json", content_encoding=" Identity ").texts == ["a wonderful film"]
    assert parse_request(body, LIMITS, "application/json", content_encoding="").texts == ["a wonderful film"]


def test_a_csv_body_is_read_no_further_than_one_row_past_the_limit():
    """Rows past `max_texts` + 1 are not parsed: a malformed row far down a long body goes unread (413 for the
    row count, not 400 for the row), so a million short lines cost what a valid body does."""
    body = b"text\n" + b"a\n" * 100 + b'"a",b\n'
    with pytest.raises(RequestError) as err:
        parse_request(body, LIMITS, "text/csv", MLFLOW_SHAPES)
    assert err.value.status == 413 and "maximum of 4" in err.value.message


def test_error_messages_are_bounded_and_never_quote_the_input():
    marker = "ECHO-MARKER"
    for body in (b'{"' + marker.encode() * 100 + b'": 1}', (marker * 100).encode() + b"\xff",
                 b'{"text": "' + marker.encode() * 50 + b'\\ud800"}'):
        with pytest.raises(RequestError) as err:
            parse_request(body, LIMITS, "application/json")
        assert marker not in err.value.message and len(err.value.message) <= MAX_ERROR_CHARS
    for content_type in (f"text/{marker}", f"application/{marker}+xml", f"multipart/{marker}",
                         f"{marker}/json-ish"):  # the media type is the client's text too
        with pytest.raises(RequestError) as err:
            parse_request(b'{"text": "a"}', LIMITS, content_type)
        assert err.value.status == 415 and marker.lower() not in err.value.message.lower(), err.value.message
    assert len(RequestError(400, "x" * 5000).message) == MAX_ERROR_CHARS


def test_json_media_types():
    assert is_json_media_type("application/json; charset=utf-8") and is_json_media_type("application/problem+json")
    assert not is_json_media_type("text/plain") and not is_json_media_type(None)
    assert is_json_media_type("application/json\t; charset=utf-8") and is_json_media_type("Application/JSON ")
    # a suffix alone, an empty subtype name, no type, or non-token text is no JSON media type
    for not_json in ("+json", "application/+json", "/x+json", "x+json", "application/x y+json", "text/plain\xa0+json"):
        assert not is_json_media_type(not_json), not_json


@pytest.mark.parametrize("space", ["\xa0", "\x85", "\u3000", "\u2028"])
def test_only_space_and_tab_surround_a_media_type(space):
    """Around a Content-Type's parts only space and tab are whitespace (RFC 9110's OWS): Unicode spaces, which
    `str.strip()` would take off, leave a type that is not JSON (415), whether after the type or a parameter."""
    for content_type in (f"application/json{space}", f"{space}application/json",
                         f"application/json; charset=utf-8{space}"):
        with pytest.raises(RequestError) as err:
            parse_request(b'{"text": "a"}', LIMITS, content_type)
        assert err.value.status == 415, (content_type, err.value.message)


@pytest.mark.parametrize("trimmed", ["\x0b\x0c\r", "\x1c", "\x1d\x1e\x1f"])
def test_a_header_values_ends_are_trimmed_as_torchserves_http_layer_trims_them(trimmed):
    """TorchServe's Netty trims Java's whitespace (with 0x1C-0x1F) off both ends of a header value before its
    handler reads it: the shared parser trims the same, so the MLflow server (h11 trims only space and tab) takes
    `application/json<0x1C>` as TorchServe does, while the same byte inside the value is refused by both."""
    assert parse_request(b'{"inputs": ["a"]}', LIMITS, f"{trimmed}application/json{trimmed}",
                         MLFLOW_SHAPES).texts == ["a"]
    with pytest.raises(RequestError) as err:
        parse_request(b'{"inputs": ["a"]}', LIMITS, f"application/json{trimmed}; charset=utf-8", MLFLOW_SHAPES)
    assert err.value.status == 415


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8), children, max_size=5),
    max_leaves=30,
)


@FEW
@given(body=st.binary(max_size=300), content_type=st.sampled_from(CONTENT_TYPES))
def test_arbitrary_bytes_raise_nothing_but_request_error(body, content_type):
    try:
        parsed = parse_request(body, LIMITS, content_type)
    except RequestError as err:
        assert 400 <= err.status < 500
    else:
        assert parsed.texts and all(t.strip() for t in parsed.texts)


@FEW
@given(value=json_values, key=st.sampled_from(["text", "texts", "other"]), as_bytes=st.booleans())
def test_arbitrary_json_raises_nothing_but_request_error(value, key, as_bytes):
    for payload in (value, {key: value}):
        body = json.dumps(payload).encode() if as_bytes else payload  # json.dumps writes NaN and "\ud800" too
        try:
            parsed = parse_request(body, LIMITS, "application/json")
        except RequestError as err:
            assert 400 <= err.status < 500
        else:
            assert all(isinstance(t, str) and t.strip() for t in parsed.texts)


@FEW
@given(depth=st.integers(0, 3000), as_bytes=st.booleans())
def test_any_nesting_depth_is_refused_or_parsed_without_recursion(depth, as_bytes):
    body = b"[" * depth + b"1" + b"]" * depth if as_bytes else nested(depth, 1)
    with pytest.raises(RequestError) as err:
        parse_request(body, factories.limits(max_body_bytes=100_000), "application/json")
    assert ("levels deep" in err.value.message or "depth" in err.value.message) if depth > 8 else \
        "must be an object" in err.value.message


@dataclass(frozen=True)
class Verdict:
    label: str
    score: float


class FakeScorer:
    """A model stand-in: texts holding BOOM fail tokenization, texts holding POISON fail any batch they are in."""

    def __init__(self) -> None:
        self.batches: list[int] = []

    def encode(self, texts):
        if any("BOOM" in t for t in texts):
            raise RuntimeError("tokenizer crashed")
        return list(texts)

    def score(self, encoded):
        self.batches.append(len(encoded))
        if any("POISON" in t for t in encoded):
            raise RuntimeError("forward pass crashed")
        return [Verdict("positive" if len(t) % 2 else "negative", 0.75) for t in encoded]


valid_texts = st.text(min_size=1, max_size=40).filter(
    lambda t: has_visible(clean_text(t)) and "BOOM" not in t and "POISON" not in t)
valid_requests = st.one_of(
    valid_texts.map(lambda t: (json.dumps({"text": t}).encode(), "application/json")),
    st.lists(valid_texts, min_size=1, max_size=4).map(lambda ts: ({"texts": ts}, "application/json")),
    valid_texts.filter(lambda t: not t.lstrip().startswith(("{", "["))).map(lambda t: (t.encode(), "text/plain")),
)
hostile_requests = st.one_of(
    st.sampled_from(POISON),
    st.binary(max_size=60).map(lambda b: (b"\xff" + b, None)),
    json_values.filter(lambda v: not isinstance(v, dict)).map(lambda v: (v, "application/json")),
    # a valid body labelled compressed: neither server decompresses, so it is refused (415), never scored
    st.tuples(valid_requests, st.sampled_from(["gzip", "br", "deflate, identity", "x-custom"])).map(
        lambda pair: (*pair[0], pair[1])),
)


@FEW
@given(requests=st.lists(st.tuples(st.booleans(), valid_requests, hostile_requests), min_size=1, max_size=8))
def test_a_mixed_batch_gets_one_answer_per_request_and_every_valid_one_a_label(requests):
    batch = [RawRequest(*(valid if is_valid else hostile)) for is_valid, valid, hostile in requests]
    answers = answer_batch(batch, FakeScorer(), LIMITS, "m")
    assert len(answers) == len(batch)
    for (is_valid, _, _), answer in zip(requests, answers, strict=True):
        if is_valid:
            assert answer.status == 200, answer.body
            labels = answer.body if isinstance(answer.body, list) else [answer.body]
            assert all(item["label"] in ("positive", "negative") and item["model"] == "m" for item in labels)
        else:
            assert 400 <= answer.status < 500 and answer.body["status"] == answer.status


def test_a_request_that_breaks_the_model_fails_alone():
    scorer = FakeScorer()
    json_type = "application/json"
    batch = [(b'{"text": "fine"}', json_type), (b'{"texts": ["ok", "POISON here"]}', json_type),
             (b"BOOM", "text/plain"), (b'{"text": "also fine"}', json_type)]
    answers = answer_batch([RawRequest(*r) for r in batch], scorer, LIMITS, "m")
    assert [a.status for a in answers] == [200, 500, 500, 200]
    assert "internal error" in answers[1].body["error"] and answers[2].body["status"] == 500
    assert scorer.batches == [4, 1, 2, 1]  # one batch of every survivor's text, then each request alone
    assert answers[0].body["label"] == "negative" and answers[3].body["label"] == "positive"


class Context:
    """What the handler uses of TorchServe's context."""

    def __init__(self, content_types: list[str | None], content_encodings: list[str | None] | None = None) -> None:
        self.content_types = content_types
        self.content_encodings = content_encodings or [None] * len(content_types)
        self.statuses: dict[int, int] = {}
        self.types: dict[int, str] = {}

    def get_all_request_header(self, idx: int) -> dict[str, object]:
        coding = {"Content-Encoding": self.content_encodings[idx]} if self.content_encodings[idx] else {}
        return {"body": {"content-type": self.content_types[idx]}, "Content-Type": self.content_types[idx], **coding}

    def set_response_header(self, idx: int, key: str, value: str) -> None:
        pass

    def set_response_status(self, code: int, phrase: str = "", idx: int = 0) -> None:
        self.statuses[idx] = code

    def set_response_content_type(self, idx: int, value: str) -> None:
        self.types[idx] = value


@pytest.fixture(scope="module")
def handler(tiny_model_dir):
    h = SentimentHandler()
    h.limits = LIMITS
    h.predictor = SentimentPredictor(tiny_model_dir, max_chars=LIMITS.max_chars_per_text)
    h.model_label = "imdb-sentiment:v1/test"
    h.initialized = True
    return h


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=st.lists(st.tuples(st.booleans(), valid_requests, hostile_requests), min_size=1, max_size=8))
def test_the_real_handler_answers_each_request_of_a_hostile_batch(handler, requests):
    batch = [RawRequest(*(valid if is_valid else hostile)) for is_valid, valid, hostile in requests]
    context = Context([r.content_type for r in batch], [r.content_encoding for r in batch])
    answers = [json.loads(a) for a in handler.handle([{"body": r.body} for r in batch], context)]
    assert len(answers) == len(batch) and set(context.statuses) == set(range(len(batch)))
    assert set(context.types.values()) == {"application/json"}
    for idx, (is_valid, _, _) in enumerate(requests):
        if is_valid:
            assert context.statuses[idx] == 200, answers[idx]
            labels = answers[idx] if isinstance(answers[idx], list) else [answers[idx]]
            assert all(item["label"] in ("positive", "negative") for item in labels)
        else:
            assert 400 <= context.statuses[idx] < 500 and answers[idx]["status"] == context.statuses[idx]


def test_the_issue_17_batch_poison_and_valid_together(handler):
    """The batch from the report: poison payloads beside valid reviews; every valid one is scored."""
    valid = [({"text": f"review {i} was {'great' if i % 2 else 'awful'}"}, "application/json") for i in range(4)]
    batch = [valid[0], POISON[0], valid[1], POISON[1], POISON[2], valid[2], POISON[3], valid[3]]
    context = Context([content_type for _, content_type in batch])
    answers = [json.loads(a) for a in handler.handle([{"data": body} for body, _ in batch], context)]
    statuses = [context.statuses[i] for i in range(len(batch))]
    assert [statuses[i] for i in (0, 2, 5, 7)] == [200] * 4
    assert all(400 <= statuses[i] < 500 for i in (1, 3, 4, 6)), statuses
    expected = handler.predictor.predict([body["text"] for body, _ in valid])
    got = [answers[i] for i in (0, 2, 5, 7)]
    assert [g["label"] for g in got] == [e.label for e in expected]


def test_limits_come_whole_from_the_package_params_or_not_at_all():
    """`Limits` holds no defaults of its own (one source: `PackageParams`): a config missing a limit is refused by
    name instead of falling back to a second copy of the default."""
    from pipeline.core.params import PackageParams

    package = vars(PackageParams())
    assert Limits.from_config(package) == Limits(package["max_texts"], package["max_body_bytes"],
                                                 package["max_chars_per_text"], package["max_json_depth"])
    partial = {k: v for k, v in package.items() if k != "max_json_depth"}
    with pytest.raises(ValueError, match="max_json_depth"):
        Limits.from_config(partial)


@pytest.mark.parametrize("body", [b'{"text": "good", "text": "bad"}', b'{"texts": ["a"], "texts": ["b"]}',
                                  b'{"inputs": {"text": ["a"], "text": ["b"]}}',
                                  b'{"dataframe_records": [{"text": "a"}, {"text": "b", "text": "c"}]}'])
def test_a_key_named_twice_anywhere_is_refused_whichever_value_would_win(body):
    """Parsers disagree on a repeated key (first or last value wins), so a body that repeats one, at any level, is
    a 400 on both servers rather than a review a proxy in front may read differently."""
    shapes = MLFLOW_SHAPES if b"inputs" in body or b"dataframe" in body else TORCHSERVE_SHAPES
    with pytest.raises(RequestError, match="same key twice") as err:
        parse_request(body, LIMITS, "application/json", shapes)
    assert err.value.status == 400
    assert parse_request(b'{"text": "good"}', LIMITS, "application/json").texts == ["good"]


@pytest.mark.parametrize("value", [None, math.nan, np.float32("nan"), np.float16("nan"), pd.NA, pd.NaT],
                         ids=["None", "nan", "float32-nan", "float16-nan", "pd.NA", "pd.NaT"])
def test_every_missing_cell_is_called_null(value):
    """However pandas or numpy writes a missing cell, the error says null (not `NAType` or `float32`)."""
    with pytest.raises(RequestError, match=r"text\[0\] must be a string, got null$"):
        check_text(value, "text[0]")


@pytest.mark.parametrize("value, kind", [(np.int64(5), "a number"), (np.float32(0.5), "a number"), (7, "a number"),
                                         (b"bytes", "bytes"), ({"a": 1}, "an object")])
def test_numpy_numbers_are_numbers(value, kind):
    with pytest.raises(RequestError, match=f"got {kind}$"):
        check_text(value, "text[0]")


@pytest.mark.parametrize("text", ["<br />", "<br/><BR>\n<br >", " \ufffd ", "\ufffd<br />\u200b"])
def test_a_text_with_nothing_left_to_score_once_cleaned_is_refused(text):
    """What the model reads is the cleaned text (`pipeline.data.cleaning`): markup or U+FFFD alone is no review."""
    with pytest.raises(RequestError, match=r"no visible character|line-break markup"):
        check_text(text, "text[0]")


@pytest.mark.parametrize("text", ["<br />great film", "a <b>fine</b> film", "<3", "caf\ufffd ok", "<br>é"])
def test_a_text_with_something_left_once_cleaned_passes(text):
    assert check_text(text, "text[0]") == text


def test_every_character_the_contract_calls_visible_is_one_the_tokenizer_keeps(tokenizer):
    """A text the contract lets through must leave the model something to read: each code point `has_visible` calls
    visible, tokenized alone, gives a token (`[UNK]` counts). Python's Unicode database and the tokenizer's can
    disagree (U+1734 is a spacing mark in Python 3.11's, dropped by the tokenizer), so every code point is run."""
    visible = [chr(c) for c in range(0x110000) if not 0xD800 <= c < 0xE000 and has_visible(chr(c))]
    text = " ".join(visible)  # one call: each character at an even offset, its tokens' offsets cover it
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    covered = {i for start, end in offsets for i in range(start, end)}
    dropped = [f"U+{ord(text[i]):04X}" for i in range(0, len(text), 2) if i not in covered]
    assert len(visible) > 100_000 and not dropped, dropped[:20]

