"""Unit: token-level preprocessing: truncation modes, re-truncation, the training window."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.data.tokens import clip_chars, encode_texts, retruncate, tokenize_frame, training_window, truncate_ids


@pytest.mark.parametrize(
    ("mode", "expected"),
    [("head", [101, 0, 1, 2, 3, 4, 5, 102]), ("head_tail", [101, 0, 15, 16, 17, 18, 19, 102])],
)
def test_truncation_modes(mode, expected):
    ids = list(range(20))
    out = truncate_ids(ids, 8, mode, 0.25, 101, 102)
    assert len(out) == 8
    assert out == expected


def test_short_reviews_are_not_truncated():
    assert truncate_ids([1, 2], 8, "head_tail", 0.25, 101, 102) == [101, 1, 2, 102]


@pytest.mark.parametrize("mode", ["head", "head_tail"])
def test_retruncating_a_tokenized_review_equals_truncating_the_original(mode):
    """`train.max_length` shortens tokenized reviews; the window must be what tokenizing short would give."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        ids = list(rng.integers(1000, 2000, int(rng.integers(1, 700))))
        long_len = int(rng.integers(16, 513))
        short_len = int(rng.integers(8, long_len + 1))
        stored = truncate_ids(ids, long_len, mode, 0.25, 101, 102)
        assert retruncate(stored, short_len, mode, 0.25, 101, 102).tolist() == truncate_ids(
            ids, short_len, mode, 0.25, 101, 102)
    with pytest.raises(ValueError, match="CLS"):
        retruncate(list(range(20)), 8, mode, 0.25, 101, 102)


def test_qat_trains_on_the_finetune_window(tokenizer):
    """The window QAT re-truncates training reviews to is the finetune stage's `train.max_length`."""
    pre = {"max_length": 64, "truncation": "head_tail", "head_fraction": 0.25}
    text = " ".join(f"word{i}" for i in range(200))
    (full,) = encode_texts([text], tokenizer, 64, truncation="head_tail", head_fraction=0.25)
    (short,) = encode_texts([text], tokenizer, 24, truncation="head_tail", head_fraction=0.25)
    window = training_window({"preprocessing": pre, "params": {"train": {"max_length": 24}}}, tokenizer)
    assert window is not None and np.array_equal(window(full), short)
    assert training_window({"preprocessing": pre, "params": {"train": {"max_length": None}}}, tokenizer) is None
    assert training_window({"preprocessing": pre, "params": {"train": {"max_length": 64}}}, tokenizer) is None


@pytest.mark.parametrize("mode", ["head", "head_tail"])
def test_clipping_characters_keeps_the_tokens_a_long_review_is_truncated_to(tokenizer, mode):
    """The serving cap on characters must not change what the model reads from a review longer than it."""
    review = " ".join(f"word{i} is {'great' if i % 3 else 'dull'}." for i in range(3000))
    clipped = clip_chars(review, 2000, mode, 0.25)
    assert len(clipped) == 2000 and len(review) > 2000
    assert clipped.startswith(review[:400]) and (mode == "head" or review.endswith(clipped[-1000:]))
    full, short = encode_texts([review, clipped], tokenizer, 64, truncation=mode, head_fraction=0.25)
    assert full.tolist() == short.tolist()
    assert clip_chars("short review", 2000, mode, 0.25) == "short review"


def test_encode_texts_takes_the_truncation_by_name_and_never_guesses_it(tokenizer):
    """The truncation and head fraction are the model's own (its record's `preprocessing`): a call that leaves them
    out, or passes them by position where another order could swap them, is refused."""
    with pytest.raises(TypeError):
        encode_texts(["a review"], tokenizer, 64)
    with pytest.raises(TypeError):
        encode_texts(["a review"], tokenizer, 64, "head_tail", 0.25)
    text = " ".join(f"word{i}" for i in range(200))
    (head,) = encode_texts([text], tokenizer, 16, truncation="head", head_fraction=0.25)
    (head_tail,) = encode_texts([text], tokenizer, 16, truncation="head_tail", head_fraction=0.25)
    assert head[:4].tolist() == head_tail[:4].tolist() and head[-2] != head_tail[-2]  # the mode named is applied


def test_a_review_that_exactly_fills_the_window_is_not_counted_as_truncated(tokenizer):
    """`truncated` (the prepare stage's `<split>_truncated_share`) says whether tokens were cut: a review of exactly
    `max_length` tokens with [CLS]/[SEP] has the same length as a cut one, and was not cut."""
    import pandas as pd

    from pipeline.core.params import DataParams

    def words(n: int) -> str:  # n tokens: the test tokenizer gives one token a word for these
        return " ".join(["good"] * n)

    assert len(tokenizer(words(14), add_special_tokens=False)["input_ids"]) == 14
    frame = tokenize_frame(pd.DataFrame({"text": [words(13), words(14), words(15)], "label": [1, 1, 0]}),
                           tokenizer, DataParams(max_length=16))
    assert frame["length"].tolist() == [15, 16, 16]
    assert frame["truncated"].tolist() == [False, False, True]


_PIECES = st.sampled_from(["good", "film", "un", "##x", "café", "naïve", "e\u0301", "東京", "😀", "a" * 120,
                           "qzxv" * 30, "....", "!?", "-", "'", " ", "  ", "\n", "\t", "\u00a0", "\u3000", "<br />"])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pieces=st.lists(st.one_of(_PIECES, st.text(min_size=1, max_size=40)), max_size=400),
       max_length=st.sampled_from([6, 16, 64]), mode=st.sampled_from(["head", "head_tail"]),
       first_span=st.sampled_from([1, 7, 64, 2048]))
def test_windowed_tokenization_gives_the_ids_of_the_whole_texts_tokenization(tokenizer, pieces, max_length, mode,
                                                                              first_span):
    """Tokenizing only spans at a text's ends (what serving does, `window_token_ids`) gives exactly the ids the
    prepare stage gets from the whole text (`truncate_ids` of its tokenization): any words, punctuation, spaces,
    accents, combining marks, CJK, emoji and over-long words, cut anywhere."""
    from pipeline.data.tokens import window_token_ids

    text = "".join(pieces)
    texts = [text, "short", text[::-1], ""]  # one batched call: the rounds handle texts of different lengths

    def whole_then_cut(t: str) -> list[int]:
        whole = tokenizer(t, add_special_tokens=False, truncation=False, verbose=False)["input_ids"]
        return truncate_ids(whole, max_length, mode, 0.25, tokenizer.cls_token_id, tokenizer.sep_token_id)

    assert window_token_ids(texts, tokenizer, max_length, truncation=mode, head_fraction=0.25,
                            first_span=first_span) == [whole_then_cut(t) for t in texts]


def test_a_long_text_is_tokenized_only_near_its_ends(tokenizer, monkeypatch):
    """A 20,000-character review of made-up words (thousands of tokens) is tokenized in spans of a few thousand
    characters, not whole: the cost a client can make one text have is bounded by the window, not the text."""
    from pipeline.data import tokens

    seen: list[int] = []
    real = tokens._whole_word_ids
    monkeypatch.setattr(tokens, "_whole_word_ids",
                        lambda tok, texts, drop: seen.extend(map(len, texts)) or real(tok, texts, drop))
    text = " ".join("qzxvbn" * 16 for _ in range(200))  # ~19,400 characters
    (ids,) = tokens.window_token_ids([text], tokenizer, 192, truncation="head_tail", head_fraction=0.25)
    assert len(ids) == 192 and 0 < max(seen) <= tokens.FIRST_SPAN_CHARS < len(text)
