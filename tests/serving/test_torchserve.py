"""Real TorchServe (the session's `server`, tests/serving/conftest.py) serving a tiny-model `.mar` with
`serving/config.properties` as shipped (also what the Docker image copies); only the ports and the model store
path are rewritten for the test. What both servers must answer alike is in test_conformance.py."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from pipeline.deployment.inference import SentimentPredictor
from serving.client import inference_key, predict, read_key_file
from tests.factories import ROOT

BIN = Path(sys.executable).parent
CONFIG = dict(line.split("=", 1) for line in (ROOT / "serving" / "config.properties").read_text().splitlines()
              if line and not line.startswith("#"))


def test_prediction_contract(server):
    status, body = server.predict({"text": "a wonderful film"})
    assert status == 200
    assert set(body) == {"label", "score", "model"}
    assert body["label"] in ("positive", "negative") and 0.5 <= body["score"] <= 1.0
    assert body["model"] == "imdb-sentiment:v7/fp32-onnx"
    expected = SentimentPredictor(server.variant_dir).predict(["a wonderful film"])[0]
    assert body["label"] == expected.label and body["score"] == pytest.approx(expected.score, abs=1e-4)


def test_list_of_texts_in_order(server):
    texts = ["great", "awful", "fine film", "boring"]
    status, body = server.predict({"texts": texts})
    assert status == 200 and isinstance(body, list) and len(body) == 4
    expected = SentimentPredictor(server.variant_dir).predict(texts)
    assert [b["score"] for b in body] == pytest.approx([e.score for e in expected], abs=1e-4)


def test_plain_text_body(server):
    status, text = server.post(b"what a great movie", content_type="text/plain")
    assert status == 200 and json.loads(text)["label"] in ("positive", "negative")


def test_token_required(server):
    status, _ = server.post(json.dumps({"text": "x"}).encode(), key=None)
    assert status in (400, 401, 403)


@pytest.mark.parametrize(
    ("body", "content_type", "status", "needle"),
    [
        (b"", "application/json", 400, "empty"),
        (b"   \n", "text/plain", 400, "empty"),
        (b'{"text": "   "}', "application/json", 400, "whitespace"),
        (b'{"text": ', "application/json", 400, "invalid JSON"),
        (b'{"review": "good"}', "application/json", 400, 'needs a \\"text\\"'),
        (b'{"text": 42}', "application/json", 400, "must be a string"),
        (b'{"texts": "one"}', "application/json", 400, "list of strings"),
        (b'["a"]', "application/json", 400, "must be an object"),
        (b"\xff\xfe\xfa bytes", "text/plain", 400, "not valid UTF-8"),
        (b"x" * 5000, "text/plain", 413, "exceeds the limit"),
        (json.dumps({"texts": ["a"] * 5}).encode(), "application/json", 413, "maximum of 4"),
    ],
)
def test_bad_input_is_a_json_4xx_and_worker_survives(server, body, content_type, status, needle):
    got, text = server.post(body, content_type)
    assert got == status, text
    err = json.loads(text)
    assert needle in json.dumps(err) and err["status"] == status
    ok, _ = server.predict({"text": "still alive"})
    assert ok == 200


def test_long_emoji_html_and_other_scripts(server):
    long_review = "A great film. " * 2000  # far beyond max_length: truncated, not an error
    texts = [
        long_review,
        "😀😀 loved it 🎬",
        "<b>bold</b> <script>alert(1)</script> fine",
        "素晴らしい映画でした",
        "фильм ужасный",
    ]
    for text in texts[1:]:
        status, body = server.predict({"text": text})
        assert status == 200, (text, body)
    status, _ = server.post(long_review.encode()[:1400], content_type="text/plain")
    assert status == 200


def _model_log(server) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted((server.workdir / "logs").glob("model_log*.log")))


def _handled_batches(log: str) -> list[int]:
    """Sizes of the batches TorchServe handed the handler, as `serving/handler.py` logs each one."""
    return [int(n) for n in re.findall(r"batch of (\d+) requests", log)]


def test_concurrent_requests_are_batched_and_mapped_back(server):
    texts = [f"review number {i} was {'great' if i % 2 else 'awful'}" for i in range(24)]
    expected = {t: p.score for t, p in zip(texts, SentimentPredictor(server.variant_dir).predict(texts), strict=True)}
    seen = len(_model_log(server))
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda t: (t, server.predict({"text": t})), texts))
    for text, (status, body) in results:
        assert status == 200
        assert body["score"] == pytest.approx(expected[text], abs=1e-3), text
    deadline = time.time() + 10  # the frontend copies the worker's log lines over asynchronously
    while sum(batches := _handled_batches(_model_log(server)[seen:])) < len(texts) and time.time() < deadline:
        time.sleep(0.2)
    assert sum(batches) >= len(texts), batches  # every request reached the handler
    # the server grouped concurrent requests into one handler call (config.properties: batchSize 8)
    assert 1 < max(batches) <= 8, batches


# Hostile payloads a client with a valid key can send (issue 17); each must get its own JSON 4xx.
POISON = [
    (b"[" * 1200 + b"]" * 1200, "application/json"),
    (b'{"text": ' + b"1" * 5000 + b"}", "application/json"),
    (b'{"text": "bad \\ud800 surrogate"}', "application/json"),
    (b"true", "application/json"),
    (b"7", "application/json"),
    (b'{"text": NaN}', "application/json"),
    (b'{"texts": [' + b"[" * 20 + b"]" * 20 + b"]}", "application/json"),
    (b"\xff\xfe bad bytes", "text/plain"),
    (json.dumps({"text": "long " * 300_000}).encode(), "application/json"),  # 1.5 MB: over max_body_bytes
    (json.dumps({"texts": ["a"] * 9}).encode(), "application/json"),
]


def test_poison_sent_concurrently_with_valid_requests_harms_only_itself(server):
    texts = [f"review {i}: the film was {'great' if i % 2 else 'dreadful'}" for i in range(16)]
    expected = {t: p for t, p in zip(texts, SentimentPredictor(server.variant_dir).predict(texts), strict=True)}
    jobs = [("valid", json.dumps({"text": t}).encode(), "application/json", t) for t in texts]
    jobs += [("poison", body, ctype, None) for body, ctype in POISON]
    random.Random(0).shuffle(jobs)  # mixed, so server-side batches hold both kinds
    seen = len(_model_log(server))
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        results = list(pool.map(lambda job: (job, server.post(job[1], job[2])), jobs * 2))
    for (kind, _, _, text), (status, body) in results:
        if kind == "valid":
            assert status == 200, body
            answer = json.loads(body)
            assert answer["label"] == expected[text].label
            assert answer["score"] == pytest.approx(expected[text].score, abs=1e-3)
        else:
            assert 400 <= status < 500, body
            assert json.loads(body)["status"] == status
    deadline = time.time() + 10  # the frontend copies the worker's log lines over asynchronously
    while sum(batches := _handled_batches(_model_log(server)[seen:])) < len(results) and time.time() < deadline:
        time.sleep(0.2)
    assert max(batches) > 1, batches  # poison and valid requests did share server-side batches


def test_body_over_the_frontend_limit_is_refused_and_the_server_goes_on(server):
    too_big = b"x" * (int(CONFIG["max_request_size"]) + 1024)
    try:
        status, _ = server.post(too_big, "text/plain")
    except (ConnectionError, urllib.error.URLError):  # the frontend may close while the body is still uploading
        status = None
    assert status in (413, None)
    ok, _ = server.predict({"text": "still here"})
    assert ok == 200


def test_a_burst_of_near_limit_bodies_leaves_the_server_answering(server):
    """More bodies just under max_request_size than the job queue holds, all at once: each is refused alone
    (the handler's JSON 413, or 503 from a full queue), and the same frontend process answers afterwards."""
    pids = server.frontend_pids()
    assert pids, "TorchServe frontend process not found"
    body = json.dumps({"text": "y" * (int(CONFIG["max_request_size"]) - 4096)}).encode()
    count = int(CONFIG["job_queue_size"]) + 20

    def send(_: int) -> int | None:
        try:
            return server.post(body)[0]
        except (ConnectionError, urllib.error.URLError):
            return None

    with ThreadPoolExecutor(max_workers=32) as pool:
        statuses = list(pool.map(send, range(count)))
    assert set(statuses) <= {413, 503}, statuses
    assert statuses.count(413) > 0
    ok, body = server.predict({"text": "after the burst"})
    assert ok == 200, body
    assert server.frontend_pids() == pids


def test_metrics_answer_without_a_key_and_ping_needs_one(server):
    with urllib.request.urlopen(f"{server.metrics_url}/metrics", timeout=10) as resp:
        assert resp.status == 200 and b"ts_inference_requests_total" in resp.read()
    req = urllib.request.Request(f"{server.url}/ping")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code in (400, 401)


def test_health_probe_reads_the_key_where_the_server_runs(server, tmp_path):
    probe = [sys.executable, "-m", "serving.health", "--url", server.url, "--management-url", "",
             "--predict", "--key-file"]
    ok = subprocess.run([*probe, str(server.workdir / "key_file.json")], cwd=ROOT, capture_output=True, text=True,
                        timeout=60)
    assert ok.returncode == 0 and "Healthy" in ok.stdout, ok.stdout + ok.stderr
    stale = tmp_path / "key_file.json"
    stale.write_text(json.dumps({"inference": {"key": "not-the-key"}}))
    bad = subprocess.run([*probe, str(stale)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "InvalidKeyException" in bad.stdout


def test_worker_killed_and_replaced(server):
    """Kill the Python worker mid-traffic: TorchServe must start a new one and answer again."""
    workers = [
        p
        for p in psutil.process_iter(["cmdline", "environ"])
        if "model_service_worker" in " ".join(p.info["cmdline"] or [])
        and str(server.workdir) in " ".join(p.info["cmdline"] or []) + str((p.info["environ"] or {}).get("TMPDIR"))
    ]
    assert workers, "no TorchServe worker process found"
    old = {w.pid for w in workers}
    for w in workers:
        w.kill()
    deadline = time.time() + 120
    answered = False
    while time.time() < deadline:
        status, _ = server.predict({"text": "back again"})
        if status == 200:
            answered = True
            break
        time.sleep(1)
    assert answered, "no successful answer after killing the worker"
    now = {
        p.pid for p in psutil.process_iter(["cmdline"]) if "model_service_worker" in " ".join(p.info["cmdline"] or [])
    }
    assert now - old, "no new worker process"


def test_client_recovers_from_a_replaced_key_through_the_key_file(server):
    """TorchServe's token API replaces the inference key (as on expiry); a client holding the old key retries
    once with the key file's new one. Runs last: the module's server key changes."""
    key_file = server.workdir / "key_file.json"
    old = inference_key(key_file)
    api = read_key_file(key_file)["API"]["key"]
    req = urllib.request.Request(f"{server.management_url}/token?type=inference",
                                 headers={"Authorization": f"Bearer {api}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 200
    server.key = inference_key(key_file)
    assert server.key != old
    assert predict(["a fine film"], server.url, old)[0] in (400, 401)  # the old key is refused
    status, body = predict(["a fine film"], server.url, old, key_file=key_file)
    assert status == 200 and body["label"] in ("positive", "negative")
