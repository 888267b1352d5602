"""Shared fixtures: repo paths, the shared IMDB copy, a tiny 2-layer BERT saved in HF format."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
IMDB_DIR = Path(os.environ.get("IMDB_DIR", ROOT.parent / "shared" / "data" / "imdb"))

os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def imdb_dir() -> Path:
    """The offline IMDB copy; the tests need it (CI has it beside the checkout)."""
    if not (IMDB_DIR / "train.parquet").is_file():
        pytest.fail(f"shared IMDB data not found at {IMDB_DIR}; set IMDB_DIR")
    return IMDB_DIR


@pytest.fixture(scope="session")
def tokenizer():
    from pipeline.config import ModelParams
    from pipeline.modeling import load_tokenizer

    return load_tokenizer(ModelParams(source="tiny"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer) -> Path:
    """A randomly initialised 2-layer BERT with our label map and the finetune stage's metadata."""
    from pipeline.config import DataParams, ModelParams, TrainParams
    from pipeline.modeling import load_model
    from pipeline.train import save_model

    d = tmp_path_factory.mktemp("tiny_model")
    model = load_model(ModelParams(source="tiny"), seed=0)
    save_model(model, tokenizer, d, DataParams(max_length=64), ModelParams(source="tiny"), TrainParams())
    return d


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


@pytest.fixture
def tokenized_dir(tmp_path, tokenizer) -> Path:
    """Tokenized train/val/test parquet files (synthetic reviews) in the prepare stage's layout."""
    from pipeline.config import DataParams
    from pipeline.data import tokenize_frame

    d = tmp_path / "tokenized"
    d.mkdir()
    params = DataParams(max_length=64)
    for split, n, seed in (("train", 96, 1), ("val", 32, 2), ("test", 32, 3)):
        tokenize_frame(synthetic_reviews(n, seed), tokenizer, params).to_parquet(d / f"{split}.parquet")
    return d
