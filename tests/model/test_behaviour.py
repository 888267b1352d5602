"""Model tier: behaviour of every exported artifact of the end-to-end model on hand-written reviews.

These run the variant directories through `SentimentPredictor` (the serving code path), so they check
the artifact and its preprocessing together, not the PyTorch model alone.
"""

from __future__ import annotations

import pytest

from pipeline.deployment.inference import SentimentPredictor

pytestmark = pytest.mark.slow

VARIANTS = ["fp32-eager", "fp32-torchscript", "fp32-onnx", "int8-dynamic", "int8-static", "int8-qat",
            "fp32-distilled", "int8-distilled", "int8-distilled-openvino"]

NEGATIVE = [
    "This was the worst movie I have ever seen. Awful acting, a boring plot and terrible dialogue. "
    "A complete waste of time and money.",
    "Dreadful. I hated every minute of it and walked out before the end.",
]
POSITIVE = [
    "A wonderful, moving film with brilliant performances. I loved every minute and will watch it again.",
    "One of the best movies of the year: beautifully shot, great acting and a superb story.",
]
NAMED = [
    "{a} and {b} give brilliant performances in this wonderful, moving film.",
    "{a} is awful and {b} is even worse; a boring, terrible mess.",
    "I expected a lot from {a}, but the film is a dull waste of time, though {b} tries hard.",
]
NAMES = [("Tom Hanks", "Meryl Streep"), ("Nicolas Cage", "Megan Fox"), ("Adam Sandler", "Emma Thompson")]


@pytest.fixture(scope="module", params=VARIANTS)
def predictor(request, repo) -> SentimentPredictor:
    name = request.param
    directory = repo / "models" / ("finetuned" if name == "fp32-eager" else f"variants/{name}")
    return SentimentPredictor(directory)


def test_clear_reviews(predictor):
    assert [p.label for p in predictor.predict(NEGATIVE)] == ["negative"] * len(NEGATIVE)
    assert [p.label for p in predictor.predict(POSITIVE)] == ["positive"] * len(POSITIVE)
    for p in predictor.predict(NEGATIVE + POSITIVE):
        assert 0.5 <= p.score <= 1.0


def test_names_do_not_matter(predictor):
    for template in NAMED:
        labels = {p.label for p in predictor.predict([template.format(a=a, b=b) for a, b in NAMES])}
        assert len(labels) == 1, (template, labels)


def test_negation_lowers_positive_probability(predictor):
    """'not good' must read less positive than 'good' (a tiny model may not flip the label outright)."""

    def p_positive(text: str) -> float:
        (p,) = predictor.predict([text])
        return p.score if p.label == "positive" else 1 - p.score

    for good, bad in [("The movie was good, I enjoyed it.", "The movie was not good, I did not enjoy it."),
                      ("I would recommend this film.", "I would not recommend this film.")]:
        assert p_positive(good) > p_positive(bad), (good, bad)


def test_batch_order_and_single_agree(predictor):
    texts = NEGATIVE + POSITIVE
    batch = predictor.predict(texts)
    singles = [predictor.predict([t])[0] for t in texts]
    assert [p.label for p in batch] == [p.label for p in singles]
    for a, b in zip(batch, singles, strict=True):
        assert a.score == pytest.approx(b.score, abs=5e-2)  # dynamic INT8 scales follow the batch
