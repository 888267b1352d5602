"""Model tier: behaviour of every exported artifact of the end-to-end model on hand-written reviews, and its
answers under concurrent calls on real ones.

These run the variant directories through `SentimentPredictor` (the serving code path), so they check
the artifact and its preprocessing together, not the PyTorch model alone. The variants are the FP32 reference
and every servable variant the default profile builds (the miniature `repo` builds them all), so whichever the
package stage serves is among them; the opt-in ones (pruned, the student's) run the same tests in
tests/e2e/test_opt_in.py (`make test-all`).
"""

from __future__ import annotations

import pandas as pd
import pytest

from pipeline.deployment.inference import SentimentPredictor
from pipeline.runtimes.catalog import REFERENCE
from pipeline.runtimes.catalog import VARIANTS as CATALOG
from pipeline.runtimes.record import read_variant
from tests.factories import concurrently

#: Stages whose variants only an opt-in setting builds (`prune.enabled`, `distill.enabled`).
OPT_IN_STAGES = ("prune", "distill")
VARIANTS = [REFERENCE, *(v.name for v in CATALOG if v.servable and v.stage not in OPT_IN_STAGES)]
OPT_IN_VARIANTS = [v.name for v in CATALOG if v.servable and v.stage in OPT_IN_STAGES]

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
    directory = repo / "models" / ("finetuned" if name == REFERENCE else f"variants/{name}")
    if name != REFERENCE:
        info = read_variant(directory)
        assert info.status == "ok", f"the miniature profile must build every servable variant: {name} {info.reason}"
    return SentimentPredictor(directory)


def test_clear_reviews(predictor):
    assert [p.label for p in predictor.predict(NEGATIVE)] == ["negative"] * len(NEGATIVE)
    assert [p.label for p in predictor.predict(POSITIVE)] == ["positive"] * len(POSITIVE)
    for p in predictor.predict(NEGATIVE + POSITIVE):
        assert 0.5 <= p.score <= 1.0  # the predicted label's probability, not the positive class's


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
    """A review scored in a batch of others of other lengths gets its answer alone (docs/batch-invariance.md:
    variants whose INT8 scales would follow the batch are scored row by row)."""
    texts = NEGATIVE + POSITIVE
    batch = predictor.predict(texts)
    singles = [predictor.predict([t])[0] for t in texts]
    assert [p.label for p in batch] == [p.label for p in singles]
    for a, b in zip(batch, singles, strict=True):
        assert a.score == pytest.approx(b.score, abs=1e-4)


def test_eight_threads_get_each_review_answered_as_alone(predictor, imdb_dir):
    """`predict` from eight threads at once (a server's request threads, a notebook's pool) on real reviews of
    mixed lengths: every answer is the review's answer alone (same label, score within 1e-4)."""
    reviews = pd.read_parquet(imdb_dir / "test.parquet", columns=["text"])["text"].sample(n=24, random_state=8)
    texts = [t[: 60 + (i * 173) % 2400] for i, t in enumerate(reviews)]
    alone = [predictor.predict([t])[0] for t in texts]
    got = concurrently(lambda i: predictor.predict([texts[i % len(texts)]])[0], 3 * len(texts), 8)
    for i, p in enumerate(got):
        assert p.label == alone[i % len(texts)].label, i
        assert abs(p.score - alone[i % len(texts)].score) <= 1e-4, (i, p.score, alone[i % len(texts)].score)
