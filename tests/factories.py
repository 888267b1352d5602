"""Helpers shared by test modules: repository paths and synthetic review data in the pipeline's layouts.

Import from here (`from tests.factories import write_tokenized`), never from a conftest: conftest modules
hold fixtures only.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
IMDB_DIR = Path(os.environ.get("IMDB_DIR", ROOT.parent / "shared" / "data" / "imdb"))


def synthetic_reviews(n: int, seed: int = 0) -> pd.DataFrame:
    """Short labelled reviews whose sentiment is carried by a few words (learnable in seconds)."""
    rng = np.random.default_rng(seed)
    pos = ["great", "wonderful", "excellent", "loved", "brilliant"]
    neg = ["awful", "terrible", "boring", "hated", "dreadful"]
    filler = ["the", "movie", "plot", "actors", "was", "really", "and", "film", "story", "scenes"]
    rows = []
    for i in range(n):
        label = int(i % 2)
        words = list(rng.choice(filler, size=int(rng.integers(3, 24))))
        for _ in range(3):  # a strong signal, so a random 2-layer BERT learns it in a few dozen steps
            words.insert(int(rng.integers(0, len(words) + 1)), str(rng.choice(pos if label else neg)))
        rows.append((" ".join(words) + f" #{i}", label))
    return pd.DataFrame(rows, columns=["text", "label"])


def write_tokenized(directory: Path, sizes: dict[str, int], max_length: int = 64) -> Path:
    """Tokenized synthetic splits in the prepare stage's layout (`{split}.parquet`)."""
    from pipeline.core.params import DataParams, ModelParams
    from pipeline.data.tokens import tokenize_frame
    from pipeline.modeling import load_tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(ModelParams(source="tiny"))
    for seed, (split, n) in enumerate(sizes.items(), start=1):
        frame = tokenize_frame(synthetic_reviews(n, seed), tok, DataParams(max_length=max_length))
        frame.to_parquet(directory / f"{split}.parquet")
    return directory
