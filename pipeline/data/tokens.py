"""Token ids: one-time tokenization, head+tail truncation, training windows, and reading the tokenized splits."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from pipeline.core.params import DataParams
from pipeline.data.cleaning import clean_text


# ---------------------------------------------------------------------------------- tokenization
def truncate_ids(ids: Sequence[int], max_length: int, truncation: str, head_fraction: float,
                 cls_id: int, sep_id: int) -> list[int]:
    """Keep a review within `max_length` tokens incl. [CLS]/[SEP].

    `head_tail` keeps the first `head_fraction` of the budget and fills the rest from the end: IMDB
    verdicts often sit in the closing sentences (Sun et al., 2019, "How to fine-tune BERT").
    """
    body = max_length - 2
    ids = list(ids)
    if len(ids) > body:
        if truncation == "head_tail":
            head = int(body * head_fraction)
            ids = ids[:head] + ids[len(ids) - (body - head) :]
        else:
            ids = ids[:body]
    return [cls_id, *ids, sep_id]


def clip_chars(text: str, max_chars: int, truncation: str, head_fraction: float) -> str:
    """Cut a text to at most `max_chars` characters before tokenizing, the way `truncate_ids` cuts tokens.

    `head_tail` keeps the first `head_fraction` of the characters and the end, so a review far longer than any
    token window still tokenizes to the same head and tail tokens while the tokenizer sees a bounded text.
    """
    if len(text) <= max_chars:
        return text
    if truncation == "head_tail":
        head = min(int(max_chars * head_fraction), max_chars - 1)
        tail = max_chars - head - 1  # one character goes to the space that keeps the cut between words
        return f"{text[:head]} {text[len(text) - tail:]}"
    return text[:max_chars]


def retruncate(ids: Sequence[int], max_length: int, truncation: str, head_fraction: float,
                cls_id: int, sep_id: int) -> np.ndarray:
    """Shorten an already truncated `[CLS] ... [SEP]` sequence to `max_length`.

    With the same truncation and head fraction this equals truncating the original review to `max_length`
    directly (the shorter head and tail lie inside the longer ones), so training can use a shorter window
    than the tokenized splits without tokenizing twice.
    """
    if len(ids) <= max_length:
        return np.asarray(ids, dtype=np.int32)
    if ids[0] != cls_id or ids[-1] != sep_id:
        raise ValueError("retruncate expects sequences written by truncate_ids ([CLS] ... [SEP])")
    return np.asarray(truncate_ids(list(ids[1:-1]), max_length, truncation, head_fraction, cls_id, sep_id),
                      dtype=np.int32)


def window_shortener(window: int | None, max_length: int, truncation: str, head_fraction: float, cls_id: int,
                     sep_id: int) -> Callable[[Sequence[int]], np.ndarray] | None:
    """`retruncate` bound to a training window (`train.max_length`) for splits tokenized to `max_length`;
    None when the window is the whole length and there is nothing to cut."""
    if window is None or window >= max_length:
        return None
    return functools.partial(retruncate, max_length=window, truncation=truncation, head_fraction=head_fraction,
                             cls_id=cls_id, sep_id=sep_id)


def tokenize_frame(df: pd.DataFrame, tokenizer: Any, params: DataParams, chunk: int = 2048) -> pd.DataFrame:
    """Token ids (unpadded, int32), length and whether `truncate_ids` cut it, per review; padding happens per batch
    later. (A review whose tokens exactly fill `max_length` was not cut: its length alone cannot tell.)"""
    out: list[np.ndarray] = []
    cut: list[bool] = []
    texts = df["text"].tolist()
    for i in range(0, len(texts), chunk):
        enc = tokenizer(texts[i : i + chunk], add_special_tokens=False, truncation=False, verbose=False)
        for ids in enc["input_ids"]:
            kept = truncate_ids(ids, params.max_length, params.truncation, params.head_fraction,
                                tokenizer.cls_token_id, tokenizer.sep_token_id)
            out.append(np.asarray(kept, dtype=np.int32))
            cut.append(len(ids) > params.max_length - 2)  # the body `truncate_ids` keeps, [CLS]/[SEP] aside
    frame = pd.DataFrame({"input_ids": out, "length": [len(x) for x in out], "truncated": cut})
    if "label" in df.columns:  # the unlabelled transfer split has none
        frame["label"] = df["label"].to_numpy()
    return frame


def encode_texts(texts: Sequence[str], tokenizer: Any, max_length: int, *, truncation: str,
                 head_fraction: float) -> list[np.ndarray]:
    """Same truncation as training, for inference paths that start from raw text. `truncation` and `head_fraction`
    have no defaults: they must be the model's own (its record's `preprocessing`), never a guess. Each text is
    tokenized only as far from each end as its window reaches (`window_token_ids`), with the same ids."""
    return [np.asarray(ids, dtype=np.int32) for ids in window_token_ids(
        [clean_text(t) for t in texts], tokenizer, max_length, truncation=truncation, head_fraction=head_fraction)]


#: How many characters `window_token_ids` first tokenizes from each end of a text longer than that: most reviews
#: are shorter, and prose fills a 192-token window in well under this; the span doubles until the window is in it.
FIRST_SPAN_CHARS = 2048


def window_token_ids(texts: Sequence[str], tokenizer: Any, max_length: int, *, truncation: str,
                     head_fraction: float, first_span: int = FIRST_SPAN_CHARS) -> list[list[int]]:
    """`truncate_ids` of each text's whole tokenization, tokenizing only spans at the ends of a long one.

    What a client may send is bounded in characters, not tokens, and a text of long made-up words costs the
    tokenizer several times what prose does per character while the model reads 192 of its thousands of tokens.
    WordPiece (like the other subword tokenizers) tokenizes each pre-tokenized word on its own, so the tokens of
    the words wholly inside a span at the start (or the end) are the first (last) tokens of the whole text; the
    word the cut may have split is dropped. A start holding more tokens than the window proves the text is cut,
    and gives its head; an end span gives the tail. Spans double until they hold enough; a text no longer than
    two spans (whose ends would overlap) is tokenized whole. Each round is one batched tokenizer call.
    """
    body = max_length - 2
    head = int(body * head_fraction) if truncation == "head_tail" else body
    if not (hasattr(tokenizer, "ids_and_words") or getattr(tokenizer, "is_fast", False)):
        first_span = max(map(len, texts), default=0)  # no word ids to cut by (a slow tokenizer): each text whole
    out: list[list[int]] = [[] for _ in texts]
    heads: dict[int, list[int]] = {}
    pending, span = list(range(len(texts))), first_span
    while pending:  # the head of each text, or the whole text where it is short or not cut
        whole = [i for i in pending if len(texts[i]) <= 2 * span]  # no more than its head and tail spans
        for i, ids in zip(whole, _whole_word_ids(tokenizer, [texts[i] for i in whole], None), strict=True):
            out[i] = truncate_ids(ids, max_length, truncation, head_fraction, tokenizer.cls_token_id,
                                  tokenizer.sep_token_id)
        cut = [i for i in pending if len(texts[i]) > 2 * span]
        starts = _whole_word_ids(tokenizer, [texts[i][:span] for i in cut], "last")
        heads.update({i: ids[:head] for i, ids in zip(cut, starts, strict=True) if len(ids) > body})
        pending, span = [i for i in cut if i not in heads], span * 2
    tail, (cls, sep) = body - head, (tokenizer.cls_token_id, tokenizer.sep_token_id)
    pending, span = (list(heads) if tail else []), first_span
    for i in heads.keys() - set(pending):  # `head` truncation: the start is all it keeps
        out[i] = [cls, *heads[i], sep]
    while pending:  # the tail of each text that is cut
        whole = [i for i in pending if len(texts[i]) <= span]  # more tokens than the window, so enough
        cut = [i for i in pending if len(texts[i]) > span]
        for group, ends in ((whole, _whole_word_ids(tokenizer, [texts[i] for i in whole], None)),
                            (cut, _whole_word_ids(tokenizer, [texts[i][-span:] for i in cut], "first"))):
            for i, ids in zip(group, ends, strict=True):
                if len(ids) >= tail:
                    out[i] = [cls, *heads[i], *ids[len(ids) - tail:], sep]
        pending, span = [i for i in cut if not out[i]], span * 2
    return out


def _whole_word_ids(tokenizer: Any, texts: list[str], drop: str | None) -> list[list[int]]:
    """Each text's token ids without those of its "last" or "first" pre-tokenized word (`drop`): the one a cut
    may have split. None keeps every token (the texts are whole)."""
    if not texts:
        return []
    if drop is None:
        return [list(ids) for ids in tokenizer(texts, add_special_tokens=False, truncation=False,
                                               verbose=False)["input_ids"]]
    if hasattr(tokenizer, "ids_and_words"):  # `SavedTokenizer`
        pairs = tokenizer.ids_and_words(texts)
    else:  # a transformers fast tokenizer
        enc = tokenizer(texts, add_special_tokens=False, truncation=False, verbose=False)
        pairs = [(ids, enc.word_ids(j)) for j, ids in enumerate(enc["input_ids"])]
    out = []
    for ids, words in pairs:
        edge = (words[-1] if drop == "last" else words[0]) if words else None
        out.append([t for t, w in zip(ids, words, strict=True) if w != edge])
    return out


def tokenizer_of(directory: str | Path) -> Any:
    """The tokenizer the splits in `directory` were tokenized with, which the prepare stage saves beside them
    (`tokenizer/`): what trains on those token ids is saved with this one, not one loaded again from the model's
    source, which may have changed since (a hub model without a pinned revision)."""
    from transformers import AutoTokenizer

    path = Path(directory) / "tokenizer"
    if not (path / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"no tokenizer beside the tokenized splits: {path} (run `dvc repro prepare`)")
    return AutoTokenizer.from_pretrained(path)


def read_tokenized(directory: str | Path, split: str) -> pd.DataFrame:
    """A tokenized split written by the prepare stage."""
    path = Path(directory) / f"{split}.parquet"
    if not path.is_file():
        raise FileNotFoundError(f"tokenized split not found: {path} (run `dvc repro prepare`)")
    return pd.read_parquet(path)


def training_window(meta: dict[str, Any], tokenizer: Any) -> Callable[[Sequence[int]], np.ndarray] | None:
    """Shorten reviews to the window the finetune stage trained on (`train.max_length` in the model's own record),
    so the steps of the stages that train further (QAT, distillation, pruning's recovery) cost what finetune steps
    cost; None when training used the full length."""

    window = (meta.get("params", {}).get("train", {}) or {}).get("max_length")
    pre = meta["preprocessing"]
    return window_shortener(None if window is None else int(window), int(pre["max_length"]), pre["truncation"],
                            float(pre["head_fraction"]), tokenizer.cls_token_id, tokenizer.sep_token_id)


def draw_rows(rows: int, count: int, seed: int) -> np.ndarray:
    """`count` distinct row indices (all rows if fewer), the same for the same seed."""
    return np.random.default_rng(seed).choice(rows, size=min(count, rows), replace=False)
