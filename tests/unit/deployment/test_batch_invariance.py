"""Unit: a review gets the same label and score alone and inside any batch (server-side batching puts one client's
review beside other clients' reviews and their padding), for every variant the package stage may serve, built
from the tiny BERT and scored on real IMDB reviews of mixed lengths through `SentimentPredictor` (the opt-in stages'
variants in the slow tier, `OPT_IN`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from pipeline.core.params import ExportParams, Params, PruneParams
from pipeline.deployment.inference import SentimentPredictor
from pipeline.runtimes.catalog import VARIANTS, spec
from tests.factories import weight_format_here

SERVABLE = [v.name for v in VARIANTS if v.servable]
#: Built only by the opt-in stages (prune, distill): the tiny model's builds of these repeat the recipes of the
#: default's variants (`fused_dynamic_int8`, `onnx_variant`, NNCF), so `make test` checks the default's and the slow
#: tier (`make test-all`) builds and checks these too.
OPT_IN = [n for n in SERVABLE if spec(n).stage in ("prune", "distill")]
TOLERANCE = 1e-4


def servable(name: str) -> Any:
    """`name` as a parametrize value, marked `slow` where only an opt-in stage builds it."""
    return pytest.param(name, id=name, marks=[pytest.mark.slow] if name in OPT_IN else [])


@pytest.fixture(scope="module")
def default_dirs(built) -> dict[str, Path]:
    """Every servable variant the default run builds, from the shared build of the tiny model."""
    dirs = {n: d for n, d in built["dirs"].items() if n in SERVABLE and n not in OPT_IN}
    assert sorted(dirs) == sorted(set(SERVABLE) - set(OPT_IN))
    return dirs


@pytest.fixture(scope="module")
def opt_in_dirs(built, tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    """int8-pruned and the distilled pair, built from the tiny model by their stages' code (the tiny model standing
    in for a student: the same recipes, `fused_dynamic_int8` and `onnx_variant`)."""
    from pipeline.variants.distilled import run_distilled_variants
    from pipeline.variants.prune import run_prune

    root = tmp_path_factory.mktemp("more-variants")
    run_prune(finetuned=tiny_model_dir, tokenized=built["tokenized"], variants_root=root,
              all_params=Params(prune=PruneParams(enabled=True, heads=1, ffn_width=64, calibration_samples=32)),
              weight_format=weight_format_here())
    run_distilled_variants(student_dir=tiny_model_dir, tokenized=built["tokenized"], variants_root=root,
                           params=Params(export=ExportParams(parity_samples=8)), weight_format=weight_format_here())
    return {n: root / n for n in OPT_IN}


@pytest.fixture
def variant_dir(request, default_dirs) -> Callable[[str], Path]:
    """The directory of a servable variant by name; the opt-in ones are built on first use."""
    return lambda name: default_dirs[name] if name in default_dirs else request.getfixturevalue("opt_in_dirs")[name]


@pytest.fixture(scope="module")
def reviews(imdb_dir) -> list[str]:
    """24 real test reviews cut to lengths from a few words to past the tiny model's 64 tokens, so every batch
    pads its shorter reviews differently."""
    texts = pd.read_parquet(imdb_dir / "test.parquet", columns=["text"])["text"].sample(n=24, random_state=3)
    return [t[: 20 + 25 * i] for i, t in enumerate(texts)]


def positive_probability(predictor: SentimentPredictor, texts: list[str]) -> np.ndarray:
    return np.array([p.score if p.label == "positive" else 1.0 - p.score for p in predictor.predict(texts)])


def mixed_batches(n: int, seed: int = 0) -> list[np.ndarray]:
    """Index batches of sizes 2, 5 and all, each from a fresh shuffle: every review meets different neighbours."""
    rng = np.random.default_rng(seed)
    batches = []
    for size in (2, 5, n):
        order = rng.permutation(n)
        batches += [order[s : s + size] for s in range(0, n, size)]
    return batches


@pytest.mark.parametrize("name", [servable(n) for n in SERVABLE])
def test_a_review_gets_the_same_answer_alone_and_in_any_batch(name, variant_dir, reviews):
    predictor = SentimentPredictor(variant_dir(name))
    alone = np.concatenate([positive_probability(predictor, [r]) for r in reviews])
    for idx in mixed_batches(len(reviews)):
        batched = positive_probability(predictor, [reviews[i] for i in idx])
        assert np.abs(batched - alone[idx]).max() <= TOLERANCE, (name, len(idx))
        assert ((batched > 0.5) == (alone[idx] > 0.5)).all(), (name, len(idx))


@pytest.mark.parametrize("name", [servable(n) for n in SERVABLE])
def test_the_record_says_how_each_servable_variant_is_batched_and_why(name, variant_dir):
    from pipeline.runtimes.batch_invariance import per_tensor_dynamic_ops, static_quantize_ir_ops
    from pipeline.runtimes.record import model_file, read_variant, variant_batching

    directory = variant_dir(name)
    info = read_variant(directory)
    record = variant_batching(directory)
    assert info.params["served_batching"] == record["served_batching"]
    dynamic = info.format == "onnx" and per_tensor_dynamic_ops(model_file(directory, info))
    static = info.format == "openvino" and static_quantize_ir_ops(model_file(directory, info))
    assert record["served_batching"] == ("rows" if dynamic or static else "batched"), name
    assert ("DynamicQuantizeLinear" in record["served_batching_reason"]) == bool(dynamic), name
    assert ("FakeQuantize" in record["served_batching_reason"]) == bool(static), name
    expected = {
        "int8-openvino": "rows",  # static INT8, whose float kernels between the quantizers follow the batch's shape
        "int8-dynamic": "rows",  # every activation quantized per batch
        "int8-static": "rows",  # its FFN down-projections quantized per batch
        "fp32-onnx": "batched",
    }
    if name in expected:
        assert info.params["served_batching"] == expected[name]
    if name == "int8-openvino":
        assert "static INT8" in info.params["served_batching_reason"]
        assert SentimentPredictor(directory).runner.describe()["batching"] == "rows"


def test_per_batch_activation_scales_are_why_rows_are_scored_alone(default_dirs, reviews):
    """Forced into one call per batch, int8-dynamic's scores move with their neighbours (the reason its record
    gives); scored row by row they do not move at all."""
    one_call = SentimentPredictor(default_dirs["int8-dynamic"], batching="batched")
    rows = SentimentPredictor(default_dirs["int8-dynamic"])
    assert rows.runner.rows_alone and not one_call.runner.rows_alone
    alone = np.concatenate([positive_probability(one_call, [r]) for r in reviews])
    together = positive_probability(one_call, reviews)
    assert np.abs(together - alone).max() > 0.0
    assert np.array_equal(positive_probability(rows, reviews), alone)


def test_rows_scored_alone_ignore_their_padding_wherever_it_is(default_dirs):
    from pipeline.runtimes.registry import load_runner

    runner = load_runner(default_dirs["int8-dynamic"])
    ids = np.array([[101, 2307, 2143, 102, 0, 0], [0, 0, 101, 2307, 2143, 102], [101, 2307, 2143, 102, 7, 8]])
    mask = np.array([[1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    logits = runner(ids, mask)
    alone = runner(ids[:1, :4], mask[:1, :4])
    assert np.array_equal(logits[0], alone[0]) and np.array_equal(logits[1], alone[0])
    assert np.array_equal(logits[2], runner(ids[2:], mask[2:])[0])


def test_an_openvino_ir_is_scored_by_rows_exactly_when_it_quantizes_activations(default_dirs, tmp_path):
    """An INT8 IR's static quantizers still meet float kernels that follow the batch's shape, so `auto` scores it
    row by row; a float IR of the same model keeps one call per batch, and its record says so."""
    import openvino as ov

    from pipeline.runtimes.batch_invariance import batching_record, scores_rows_alone, static_quantize_ir_ops

    int8 = default_dirs["int8-openvino"] / "model.xml"
    assert static_quantize_ir_ops(int8)["FakeQuantize"] > 0 and scores_rows_alone(int8)
    assert not scores_rows_alone(int8, "batched")
    float_ir = tmp_path / "model.xml"
    ov.save_model(ov.convert_model(default_dirs["fp32-onnx"] / "model.onnx"), float_ir)
    assert static_quantize_ir_ops(float_ir) == {} and not scores_rows_alone(float_ir)
    assert batching_record("openvino", float_ir)["served_batching"] == "batched"
    assert scores_rows_alone(float_ir, "rows")
