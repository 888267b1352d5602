"""One conformance suite, run against both real servers (the session's TorchServe `server` and MLflow's scoring
server `champion`, tests/serving/conftest.py): the contract of `pipeline.deployment.protocol` must hold alike on
both. Every hostile body gets the same 4xx on both, with a bounded JSON error that names the problem and never
quotes the input, and a valid request right after it still gets its labels; every valid shape gets a label per
text equal to the in-process predictor's; generated bodies get exactly the verdict of the in-process contract;
poison sent concurrently with valid requests leaves their answers untouched; uploads stalled half-way leave a valid
request answered; every answer carries the model's version and variant."""

from __future__ import annotations

import dataclasses
import http.client
import json
import random
import socket
import urllib.parse
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.deployment.inference import SentimentPredictor
from pipeline.deployment.protocol import (
    MLFLOW_SHAPES,
    REQUEST_ID_HEADER,
    SCORE_DECIMALS,
    TORCHSERVE_SHAPES,
    VARIANT_HEADER,
    VERSION_HEADER,
    Limits,
    RequestError,
)
from pipeline.deployment.request_parsing import parse_request
from tests.factories import SERVING_LIMITS

LIMITS = Limits(**SERVING_LIMITS)
MAX_ERROR_BYTES = 512
MARKER = "ECHO-MARKER-7f3a"  # in every hostile body that has room for it: an error must never quote it
JSON = "application/json"


@dataclass(frozen=True)
class Endpoint:
    """One server as the suite drives it: where to POST, the key, and how a list of texts is wrapped."""

    name: str
    url: str
    key: str | None
    wrap: Callable[[list[Any]], dict[str, Any]]
    shapes: frozenset[str]
    variant_dir: Path
    version: str

    def post(self, body: bytes, content_type: str | None = JSON, method: str = "POST",
             path: str | None = None, extra: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        """One request with exactly these headers (urllib would add a form-encoded Content-Type of its own)."""
        url = urllib.parse.urlsplit(self.url)
        headers = {"Content-Type": content_type} if content_type is not None else {}
        headers.update(extra or {})
        if self.key:
            headers["Authorization"] = f"Bearer {self.key}"
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
        try:
            conn.request(method, path or url.path, body=body, headers=headers)
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()

    def labels(self, body: bytes) -> list[tuple[str, float]]:
        answer = json.loads(body)
        items = answer["predictions"] if isinstance(answer, dict) and "predictions" in answer else answer
        items = items if isinstance(items, list) else [items]
        return [(item["label"], item["score"]) for item in items]


def _torchserve(server) -> Endpoint:
    return Endpoint("torchserve", f"{server.url}/predictions/sentiment", server.key, lambda texts: {"texts": texts},
                    TORCHSERVE_SHAPES, server.variant_dir, "7")


def _mlflow(champion) -> Endpoint:
    return Endpoint("mlflow", f"{champion['url']}/invocations", None, lambda texts: {"inputs": texts},
                    MLFLOW_SHAPES, champion["variant_dir"], champion["manifest"]["registered_model"]["version"])


@pytest.fixture(scope="module", params=["torchserve", "mlflow"])
def endpoint(request) -> Endpoint:
    if request.param == "torchserve":
        return _torchserve(request.getfixturevalue("server"))
    return _mlflow(request.getfixturevalue("champion"))


@pytest.fixture(scope="module")
def predictor(endpoint) -> SentimentPredictor:
    return SentimentPredictor(endpoint.variant_dir)


def _body(endpoint: Endpoint, texts: list[Any]) -> bytes:
    return json.dumps(endpoint.wrap(texts)).encode()


def _raw(endpoint: Endpoint, literal: bytes) -> bytes:
    """The endpoint's wrapper around one value written as raw JSON `literal` (NaN, 1e400, a lone surrogate)."""
    return _body(endpoint, ["@@"]).replace(b'"@@"', literal)


# (case, body builder, content type, status, words the error must hold). The same statuses on both servers.
HOSTILE: list[tuple[str, Callable[[Endpoint], bytes], str | None, int, str]] = [
    ("null text", lambda e: _body(e, [None]), JSON, 400, "must be a string, got null"),
    ("number text", lambda e: _body(e, [5]), JSON, 400, "must be a string, got a number"),
    ("array text", lambda e: _body(e, [[MARKER]]), JSON, 400, "must be a string, got an array"),
    ("blank text", lambda e: _body(e, ["  \t\n "]), JSON, 400, "whitespace only"),
    ("invisible text", lambda e: _body(e, ["\u200b\u200e\u202e\u2066\u0007\ufeff"]), JSON, 400,
     "no visible character"),
    ("replacement characters only", lambda e: _body(e, ["\ufffd \ufffd\u200b"]), JSON, 400, "no visible character"),
    ("blank filler characters only", lambda e: _body(e, ["\u3164\u115f \u2800\uffa0"]), JSON, 400,
     "no visible character"),
    ("line-break markup only", lambda e: _body(e, ["<br /><BR>\n<br/> "]), JSON, 400, "line-break markup"),
    ("empty list", lambda e: _body(e, []), JSON, 400, "no texts"),
    ("too many rows", lambda e: _body(e, [MARKER] * (LIMITS.max_texts + 1)), JSON, 413, "exceed the maximum"),
    ("too long a text", lambda e: _body(e, [MARKER + "x" * LIMITS.max_chars_per_text]), JSON, 413,
     "more than the limit"),
    ("too large a body", lambda e: _body(e, [MARKER + " y" * LIMITS.max_body_bytes]), JSON, 413,
     "exceeds the limit"),
    ("deep nesting", lambda e: b"[" * 1500 + b"]" * 1500, JSON, 400, "depth"),
    ("nesting past the limit", lambda e: _body(e, [[[[[[[[[MARKER]]]]]]]]]), JSON, 400, "levels deep"),
    ("number beyond a double", lambda e: _raw(e, b"1" * 400), JSON, 400, "invalid JSON"),
    ("NaN", lambda e: _raw(e, b"NaN"), JSON, 400, "invalid JSON"),
    ("lone surrogate", lambda e: _raw(e, b'"' + MARKER.encode() + b' \\ud800"'), JSON, 400, "invalid JSON"),
    ("invalid UTF-8", lambda e: _raw(e, b'"' + MARKER.encode() + b' \xff\xfe"'), JSON, 400, "not valid UTF-8"),
    ("invalid JSON", lambda e: _body(e, [MARKER])[:-3], JSON, 400, "invalid JSON"),
    ("JSON scalar", lambda e: b"true", JSON, 400, "must be an object"),
    ("JSON array", lambda e: json.dumps([MARKER]).encode(), JSON, 400, "must be an object"),
    ("wrong key", lambda e: json.dumps({"review": MARKER}).encode(), JSON, 400, "needs"),
    ("two shapes", lambda e: json.dumps({**{k: [MARKER] for k in sorted(e.shapes - {"plain", "csv", "text"})},
                                         "text": MARKER} if "text" in e.shapes else
                                        {"inputs": [MARKER], "instances": [MARKER]}).encode(), JSON, 400, " and "),
    ("extra field", lambda e: json.dumps({**e.wrap([MARKER]), "params": {"k": 1}}).encode(), JSON, 400,
     "besides"),
    ("empty body", lambda e: b"", JSON, 400, "empty"),
    ("form-encoded JSON", lambda e: _body(e, [MARKER]), "application/x-www-form-urlencoded", 415, "form-encoded"),
    ("missing Content-Type", lambda e: _body(e, [MARKER]), None, 415, "no Content-Type"),
    ("other charset", lambda e: _body(e, [MARKER]), "application/json; charset=latin-1", 415, "charset"),
    # read two ways: a proxy that takes the first would read latin-1, the last is utf-8
    ("charset twice", lambda e: _body(e, [MARKER]), "application/json; charset=latin-1; charset=utf-8", 415,
     "more than once (charset)"),
    ("charset twice, the same", lambda e: _body(e, [MARKER]), "application/json; charset=utf-8; Charset=UTF-8", 415,
     "more than once (charset)"),
    ("unknown media type", lambda e: _body(e, [MARKER]), "application/xml", 415, "not accepted"),
    ("media type made of the input", lambda e: _body(e, ["a"]), f"text/{MARKER}", 415, "this Content-Type"),
    ("multipart type made of the input", lambda e: _body(e, ["a"]), f"multipart/{MARKER}", 415, "(multipart)"),
    ("a thousand empty arrays", lambda e: _raw(e, b"[" + b",".join([b"[]"] * 1000) + b"]"), JSON, 413,
     "values"),
    ("a key named twice", lambda e: _body(e, ["a fine film"])[:-1] + b", " + _body(e, [MARKER])[1:], JSON, 400,
     "same key twice"),
]


def _names_the_model(endpoint: Endpoint, headers: dict[str, str]) -> bool:
    return headers.get(VERSION_HEADER.lower()) == endpoint.version and \
        headers.get(VARIANT_HEADER.lower()) == "fp32-onnx"


def _check_error(endpoint: Endpoint, status: int, headers: dict[str, str], body: bytes, want: int,
                 needle: str) -> None:
    assert status == want, (endpoint.name, status, body[:300])
    assert len(body) <= MAX_ERROR_BYTES, (endpoint.name, len(body))
    assert MARKER.lower().encode() not in body.lower()  # nor lower-cased, as a media type would be
    error = json.loads(body)
    assert set(error) == {"error", "status", "request_id"} and error["status"] == status, error
    assert error["request_id"] and headers.get(REQUEST_ID_HEADER.lower()) == error["request_id"], (error, headers)
    assert needle in error["error"], (endpoint.name, error)
    assert _names_the_model(endpoint, headers), headers


@pytest.mark.parametrize(("case", "build", "content_type", "status", "needle"), HOSTILE,
                         ids=[case for case, *_ in HOSTILE])
def test_a_hostile_body_gets_its_4xx_and_the_next_valid_request_its_labels(endpoint, predictor, case, build,
                                                                           content_type, status, needle):
    body = build(endpoint)
    with pytest.raises(RequestError) as verdict:  # the in-process contract says the same
        parse_request(body, LIMITS, content_type, endpoint.shapes)
    assert verdict.value.status == status
    _check_error(endpoint, *endpoint.post(body, content_type), status, needle)
    ok, headers, answer = endpoint.post(_body(endpoint, ["a fine film after a bad request"]))
    assert ok == 200, answer
    assert _names_the_model(endpoint, headers)


@pytest.mark.parametrize("coding", ["gzip", "br", "identity"])
def test_a_body_with_a_content_coding_is_a_415_on_both_servers(endpoint, coding):
    """Neither server decompresses, and both are told the request's Content-Encoding: a gzip body is refused as
    compressed (not as invalid UTF-8), a plain body labelled compressed is not scored, `identity` is no coding."""
    import gzip

    body = _body(endpoint, ["a wonderful film"])
    for sent in (body, gzip.compress(body)) if coding != "identity" else (body,):
        status, headers, answer = endpoint.post(sent, JSON, extra={"Content-Encoding": coding})
        if coding == "identity":
            assert status == 200 and endpoint.labels(answer), answer[:300]
        else:
            _check_error(endpoint, status, headers, answer, 415, f"compressed body ({coding})")
    if coding != "identity":  # the coding is refused before the size: a large compressed body is a 415 on both
        status, headers, answer = endpoint.post(b"x" * (LIMITS.max_body_bytes + 10), JSON,
                                                extra={"Content-Encoding": coding})
        _check_error(endpoint, status, headers, answer, 415, f"compressed body ({coding})")


TEXTS = ["A wonderful, moving film; the cast is superb.", "NA", "素晴らしい映画でした 😀",
         'quotes " and, commas\nand a newline']  # "NA": a review pandas would read from CSV as missing


def _valid_bodies(endpoint: Endpoint) -> list[tuple[str, bytes, str]]:
    if endpoint.name == "torchserve":
        return [("text", json.dumps({"text": TEXTS[0]}).encode(), JSON),
                ("texts", json.dumps({"texts": TEXTS}).encode(), JSON),
                ("plain", TEXTS[2].encode(), "text/plain; charset=utf-8")]
    csv_body = "text\n" + "".join('"' + t.replace('"', '""') + '"\n' for t in TEXTS)
    return [("dataframe_split", json.dumps({"dataframe_split": {"columns": ["text"],
                                                                "data": [[t] for t in TEXTS]}}).encode(), JSON),
            ("dataframe_records", json.dumps({"dataframe_records": [{"text": t} for t in TEXTS]}).encode(), JSON),
            ("inputs", json.dumps({"inputs": TEXTS}).encode(), JSON),
            ("inputs as columns", json.dumps({"inputs": {"text": TEXTS}}).encode(), JSON),
            ("instances", json.dumps({"instances": TEXTS}).encode(), JSON),
            ("instances as records", json.dumps({"instances": [{"text": t} for t in TEXTS]}).encode(), JSON),
            ("csv", csv_body.encode(), "text/csv")]


def test_every_valid_shape_gets_a_label_per_text_like_the_predictor(endpoint, predictor):
    for shape, body, content_type in _valid_bodies(endpoint):
        texts = parse_request(body, LIMITS, content_type, endpoint.shapes).texts
        status, headers, answer = endpoint.post(body, content_type)
        assert status == 200, (shape, answer[:300])
        assert _names_the_model(endpoint, headers)
        want = predictor.predict(texts)
        got = endpoint.labels(answer)
        assert [g[0] for g in got] == [w.label for w in want], shape
        assert [g[1] for g in got] == pytest.approx([w.score for w in want], abs=1e-5), shape
        assert all(round(g[1], SCORE_DECIMALS) == g[1] for g in got), (shape, got)  # both servers: 6 decimals


def behind_proxy(endpoint: Endpoint, request: pytest.FixtureRequest) -> Endpoint:
    """TorchServe's `endpoint` reached through `serving/nginx.conf` (the Docker image's proxy, the `proxy` fixture),
    for what only the proxy can refuse: TorchServe's handler is not told the method, and its frontend decodes form
    bodies before the handler."""
    return dataclasses.replace(endpoint, name="torchserve behind nginx",
                               url=f"{request.getfixturevalue('proxy')}/predictions/sentiment")


def test_only_the_documented_method_scores(endpoint, request):
    """MLflow's middleware refuses other methods and paths itself; TorchServe's handler is not told the method,
    so for TorchServe this runs through `serving/nginx.conf` (the Docker image's proxy) in front of it."""
    if endpoint.name == "torchserve":
        endpoint = behind_proxy(endpoint, request)
        status, _, body = endpoint.post(_body(endpoint, ["a fine film through the proxy"]))
        assert status == 200 and endpoint.labels(body), body[:300]
        status, _, body = endpoint.post(b"x" * (1024 * 1024 + 1), "text/plain")
        assert status == 413 and json.loads(body)["status"] == 413
    for method in ("GET", "PUT", "DELETE", "PATCH"):
        status, headers, body = endpoint.post(_body(endpoint, [MARKER]), JSON, method)
        assert status == 405 and headers.get("allow") == "POST" and MARKER.encode() not in body, (method, status)
        assert json.loads(body)["status"] == 405
    status, _, body = endpoint.post(b"", None, "OPTIONS", "/")
    assert status in (404, 405) and len(body) <= MAX_ERROR_BYTES and json.loads(body)["status"] == status
    path = urllib.parse.urlsplit(endpoint.url).path
    status, _, body = endpoint.post(_body(endpoint, ["ok"]), JSON, "POST", f"{path}?{MARKER}{'a' * 20_000}")
    assert status == 414 and len(body) <= MAX_ERROR_BYTES and MARKER.encode() not in body


#: Form bodies (Content-Type, body) TorchServe's frontend would decode itself before its handler: malformed, its
#: 500 quoting the body back; many empty fields, frontend time while other requests wait (half a million in 1 MiB
#: took it seconds: test_proxy.py sends that size to the proxy; the limits here are smaller).
FORM_BODIES = (
    ("application/x-www-form-urlencoded", f"text={MARKER}%zz".encode()),
    ('multipart/form-data; boundary="', MARKER.encode()),
    ("multipart/form-data; boundary=a; boundary=b", f"--a\r\n\r\n{MARKER}\r\n--a--".encode()),
    ("application/x-www-form-urlencoded", b"a&" * (LIMITS.max_body_bytes // 2 - 1)),
)


def test_form_bodies_are_refused_before_anything_decodes_them(endpoint, request):
    """Form and multipart bodies get the contract's 415 on both servers, without the input quoted: the MLflow
    server's middleware refuses them, and for TorchServe `serving/nginx.conf` does, before TorchServe's frontend
    would decode them; a valid request right after each is answered."""
    if endpoint.name == "torchserve":
        endpoint = behind_proxy(endpoint, request)
    for content_type, body in FORM_BODIES:
        status, headers, answer = endpoint.post(body, content_type)
        assert status == 415 and len(answer) <= MAX_ERROR_BYTES, (content_type, status, answer[:200])
        error = json.loads(answer)
        assert error["status"] == 415 and MARKER.encode() not in answer, content_type
        assert error["request_id"] and headers.get("x-request-id") == error["request_id"], (content_type, headers)
        status, _, answer = endpoint.post(_body(endpoint, ["a fine film"]))
        assert status == 200 and endpoint.labels(answer), answer[:300]


def test_concurrent_poison_leaves_valid_neighbours_untouched(endpoint, predictor):
    texts = [f"review {i}: the film was {'great' if i % 2 else 'dreadful'}" for i in range(12)]
    expected = dict(zip(texts, predictor.predict(texts), strict=True))
    jobs: list[tuple[str | None, bytes, str | None]] = [(t, _body(endpoint, [t]), JSON) for t in texts]
    jobs += [(None, build(endpoint), content_type) for _, build, content_type, _, _ in HOSTILE]
    random.Random(0).shuffle(jobs)
    with ThreadPoolExecutor(max_workers=16) as pool:
        results = list(pool.map(lambda job: (job, endpoint.post(job[1], job[2])), jobs))
    for (text, _, _), (status, _, body) in results:
        if text is None:
            assert 400 <= status < 500, body[:300]
            continue
        assert status == 200, body[:300]
        [(label, score)] = endpoint.labels(body)
        assert label == expected[text].label and score == pytest.approx(expected[text].score, abs=1e-4)


def test_stalled_uploads_do_not_keep_a_valid_request_waiting(endpoint, predictor):
    """70 clients (more than the MLflow server's 64 scoring slots) send the start of a body and stall, holding their
    connections: a complete request beside them is answered at once, with its labels."""
    url = urllib.parse.urlsplit(endpoint.url)
    auth = f"Authorization: Bearer {endpoint.key}\r\n" if endpoint.key else ""
    head = (f"POST {url.path} HTTP/1.1\r\nHost: {url.hostname}\r\nContent-Type: {JSON}\r\n{auth}"
            "Content-Length: 100\r\n\r\n").encode()
    stalled: list[socket.socket] = []
    try:
        for _ in range(70):
            stalled.append(socket.create_connection((url.hostname, url.port), timeout=10))
            stalled[-1].sendall(head + b'{"inp')
        text = "a wonderful, moving film"
        status, _, body = endpoint.post(_body(endpoint, [text]))
        assert status == 200, body[:300]
        [(label, score)] = endpoint.labels(body)
        [want] = predictor.predict([text])
        assert label == want.label and score == pytest.approx(want.score, abs=1e-4)
    finally:
        for sock in stalled:
            sock.close()


json_leaves = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30)
json_values = st.recursive(json_leaves, lambda children: st.lists(children, max_size=4)
                           | st.dictionaries(st.text(max_size=6), children, max_size=3), max_leaves=12)
content_types = st.sampled_from([JSON, "application/json; charset=utf-8", "text/plain", "text/csv", None])


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_generated_bodies_get_the_contracts_verdict(endpoint, data):
    kind = data.draw(st.sampled_from(["texts", "value", "bytes"]))
    if kind == "texts":  # the endpoint's own shape, holding anything JSON can
        body = json.dumps(endpoint.wrap(data.draw(st.lists(json_values, min_size=0, max_size=5)))).encode()
    elif kind == "value":
        body = json.dumps(data.draw(json_values)).encode()
    else:
        body = data.draw(st.binary(max_size=200))
    content_type = data.draw(content_types)
    try:
        parsed = parse_request(body, LIMITS, content_type, endpoint.shapes)
    except RequestError as err:
        want = err.status
    else:
        want = 200
    status, _, answer = endpoint.post(body, content_type)
    assert status == want, (body[:200], content_type, answer[:300])
    if want == 200:
        assert len(endpoint.labels(answer)) == len(parsed.texts)
    else:
        assert len(answer) <= MAX_ERROR_BYTES and json.loads(answer)["status"] == want
