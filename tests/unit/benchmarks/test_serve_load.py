"""Unit: the serving soak's malformed mix and target check (the load itself needs a running server)."""

from __future__ import annotations

import json

import pytest

from benchmarks.serve_load import Endpoint, malformed_bodies, table, targets, torchserve_batching
from pipeline.deployment.protocol import Limits, RequestError
from pipeline.deployment.request_parsing import parse_request


def test_every_kind_of_malformed_request_is_refused_by_the_protocol():
    limits = Limits(max_texts=4, max_body_bytes=2048)
    kinds = malformed_bodies(limits.max_body_bytes, limits.max_texts)
    assert len({kind for kind, _, _ in kinds}) == len(kinds) >= 8
    for _, body, content_type in kinds:
        with pytest.raises(RequestError):
            parse_request(body, limits, content_type)


def test_the_mlflow_poison_is_the_same_kinds_in_mlflows_request_format():
    ts = dict((kind, body) for kind, body, _ in malformed_bodies(2048, 4))
    ml = dict((kind, body) for kind, body, _ in malformed_bodies(2048, 4, "mlflow"))
    assert ts.keys() == ml.keys()
    assert ml["not-a-string"] == b'{"dataframe_records": [{"text": 42}]}'
    assert len(json.loads(ml["too-many-texts"])["dataframe_records"]) == 5
    assert len(ml["oversized"]) > 2048


def test_an_answer_counts_only_with_a_label_for_the_one_review_sent():
    mlflow, ts = Endpoint("mlflow", "http://127.0.0.1:5001"), Endpoint("torchserve", "http://127.0.0.1:8080")
    assert json.loads(mlflow.body("good")) == {"dataframe_records": [{"text": "good"}]}
    assert mlflow.path == "/invocations" and ts.path == "/predictions/sentiment"
    assert mlflow.answered({"predictions": [{"label": "positive", "score": 0.9}]})
    assert not mlflow.answered({"predictions": []}) and not mlflow.answered({"label": "positive"})
    assert ts.answered({"label": "positive", "score": 0.9}) and not ts.answered({"error": "x"})


def test_the_recorded_batching_is_the_config_torchserve_starts_with():
    settings = torchserve_batching()
    assert {"batchSize", "maxBatchDelay", "minWorkers", "maxWorkers"} <= settings.keys()


def _row(concurrency, errors=0, ok_pct=100.0, p50=10.0, p99=20.0, ratio=0.9):
    return {"concurrency": concurrency, "valid_sent": 100, "valid_ok_pct": ok_pct, "valid_errors": errors,
            "malformed_4xx_pct": 100.0, "p50_ms": p50, "p99_ms": p99, "requests_per_s": 50.0,
            "in_process_per_s": 50.0 / ratio, "served_vs_in_process": ratio}


def test_targets_read_the_sweep():
    good = targets([_row(1), _row(8), _row(32)], 0.1)
    assert all(good.values())
    bad = targets([_row(1, errors=1, ok_pct=99.0, ratio=0.6), _row(8, p99=31.0, ratio=0.7)], 0.1)
    assert not any(bad.values())
    assert bad["served_at_least_0.8_of_in_process_at_32"] is None  # not in this sweep
    assert targets([_row(1, ratio=0.75)], 0.1)["served_at_least_0.8_of_in_process_at_1"] is False
    assert targets([_row(1, ratio=0.85)], 0.1)["served_at_least_0.8_of_in_process_at_1"] is True
    failed_warmup = {**_row(1), "warmup": {"seconds": 15.0, "requests": 300, "errors": 2}}
    assert targets([failed_warmup], 0.1)["zero_errors_on_valid"] is False  # an error while warming up counts too
    assert targets([_row(1)], 0.0)["p99_at_most_3x_p50_at_8"] is None
    assert targets([_row(8)], 0.0)["all_valid_answered_200_with_malformed_mixed_in"] is None
    assert "| 8 | 100 | 100.00 | 0 |" in table([_row(8)])
