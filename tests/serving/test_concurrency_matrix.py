"""Serving: the concurrency matrix. Both real servers (TorchServe and `python -m serving.mlflow_server`), each
variant of `matrix` (one per runtime and batching path, plus the variant the default profile serves, whichever it
is), at 8 and 32 concurrent clients sending real IMDB reviews of mixed lengths, one or several per request: no
valid request fails, and every answer equals the same review scored alone in-process (same label, score within
1e-4); TorchServe's answers name their archive's version and variant, the OpenVINO IR's as every other. The MLflow
server once failed 88 % of requests at 8 clients ("Infer Request is busy" from a shared
OpenVINO request, answered 400)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import pandas as pd
import pytest

from pipeline.deployment.inference import Prediction, SentimentPredictor
from tests.factories import concurrently

LEVELS = (8, 32)
#: Requests each client sends per level: enough for every client to be in flight together many times.
REQUESTS_PER_LEVEL = 96


@pytest.fixture(scope="module")
def reviews(imdb_dir) -> list[str]:
    """Real reviews cut to lengths from a sentence to past the tiny model's 64-token window."""
    texts = pd.read_parquet(imdb_dir / "test.parquet", columns=["text"])["text"].sample(n=48, random_state=11)
    return [t[: 30 + (i * 131) % 1800] for i, t in enumerate(texts)]


@pytest.fixture(scope="module")
def alone(matrix, reviews) -> dict[str, list[Prediction]]:
    """Each review scored on its own, in this process, per variant (texts cut as the servers cut them)."""
    out = {}
    for name in matrix["variants"]:
        predictor = SentimentPredictor(matrix["dirs"][name], max_chars=matrix["limits"].max_chars_per_text)
        out[name] = [predictor.predict([t])[0] for t in reviews]
    return out


def request_texts(i: int, reviews: list[str]) -> list[int]:
    """Review indices of request `i`: one review for most, two or three for some (a request of several)."""
    size = 1 if i % 4 else 1 + i % 3
    return [(i * 7 + k) % len(reviews) for k in range(size)]


def post(url: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[int, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode("utf-8", "replace")[:300]


def check(answers: list[tuple[int, Any]], reviews: list[str], expected: list[Prediction], where: str,
          model: str | None = None) -> None:
    """Every request answered, each review as alone; `model`: what each answer must name as its model."""
    failed = [(i, a) for i, a in enumerate(answers) if a[0] != 200]
    assert not failed, f"{where}: {len(failed)} of {len(answers)} valid requests failed, e.g. {failed[:3]}"
    for i, (_, predictions) in enumerate(answers):
        for k, got in zip(request_texts(i, reviews), predictions, strict=True):
            assert model is None or got["model"] == model, (where, i, k, got.get("model"))
            assert got["label"] == expected[k].label, (where, i, k)
            assert abs(got["score"] - expected[k].score) <= 1e-4, (where, i, k, got["score"], expected[k].score)


def test_the_default_served_variant_is_in_the_matrix(matrix):
    assert matrix["served"] in matrix["variants"]


@pytest.mark.parametrize("level", LEVELS)
def test_mlflow_server_answers_every_concurrent_caller_as_the_review_alone(matrix, reviews, alone, level):
    for name in matrix["variants"]:
        url = f"{matrix['mlflow'][name]}/invocations"

        def send(i: int, url: str = url) -> tuple[int, Any]:
            status, body = post(url, {"inputs": [reviews[k] for k in request_texts(i, reviews)]}, {})
            return status, body["predictions"] if status == 200 else body

        check(concurrently(send, REQUESTS_PER_LEVEL, level), reviews, alone[name], f"mlflow {name} at {level}")


@pytest.mark.parametrize("level", LEVELS)
def test_torchserve_answers_every_concurrent_caller_as_the_review_alone(matrix, reviews, alone, level):
    server = matrix["torchserve"]
    for name in matrix["variants"]:
        url = f"{server.url}/predictions/{name}"

        def send(i: int, url: str = url) -> tuple[int, Any]:
            return post(url, {"texts": [reviews[k] for k in request_texts(i, reviews)]},
                        {"Authorization": f"Bearer {server.key}"})

        # each archive answers as its registry version and variant (the matrix packages version 1 of each)
        check(concurrently(send, REQUESTS_PER_LEVEL, level), reviews, alone[name], f"torchserve {name} at {level}",
              model=f"imdb-sentiment:v1/{name}")
