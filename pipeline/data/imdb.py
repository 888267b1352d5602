"""IMDB loading, the reference split, cleaning and integrity checks.

Three sources give the same frame (`text`, `label`): the Hugging Face hub (`stanfordnlp/imdb`), the
parquet layout of the offline copy, and the original `aclImdb/{train,test}/{pos,neg}/*.txt` archive."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from pipeline.core.errors import UserError
from pipeline.core.params import DataParams
from pipeline.data.cleaning import clean_text

log = logging.getLogger(__name__)


SPLITS = ("train", "val", "test")


#: Reviews of the train split the subsample left out, drawn without their labels for the distill stage's
#: teacher labelling (`data.transfer_reviews`); written beside the labelled splits, never with a label column.
TRANSFER = "transfer"


LABELS = {0: "negative", 1: "positive"}


class DataSourceError(UserError):
    """The configured IMDB source cannot be read; the message says what to set."""


class DataValidationError(UserError):
    """The prepared splits break an integrity rule (leakage, labels, empty text)."""


# --------------------------------------------------------------------------------------- loading
def load_imdb(params: DataParams, local_dir: str | Path | None = None) -> pd.DataFrame:
    """All labelled reviews of the configured source as one frame with `text` and `label`."""
    directory = Path(local_dir if local_dir is not None else params.local_dir)
    if params.source == "hub":
        frame = _load_hub(params.hub_name, params.hub_revision)
    elif params.source == "parquet":
        frame = _load_parquet(directory)
    else:
        frame = _load_aclimdb(directory)
    log.info("loaded %d labelled reviews from %s", len(frame), params.source)
    return frame


def _hint(directory: Path) -> str:
    return (
        f"Set data.local_dir in params.yaml (or run `make run IMDB_DIR=/path/to/imdb`); "
        f"it is now {directory.resolve()}. Or set data.source: hub on a machine with network."
    )


def _load_hub(name: str, revision: str) -> pd.DataFrame:
    try:
        import datasets

        ds = datasets.load_dataset(name, revision=revision)
    except Exception as exc:  # network, auth or name errors all end the same way for the user
        raise DataSourceError(
            f"could not load '{name}' (revision {revision}) from the Hugging Face hub ({type(exc).__name__}: {exc}). "
            "Without network use data.source: parquet or aclimdb with data.local_dir."
        ) from exc
    parts = [ds[s].to_pandas()[["text", "label"]] for s in ("train", "test") if s in ds]
    return pd.concat(parts, ignore_index=True)


def _load_parquet(directory: Path) -> pd.DataFrame:
    files = [directory / f"{s}.parquet" for s in ("train", "test")]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise DataSourceError(f"IMDB parquet files {missing} not found in {directory}. {_hint(directory)}")
    parts = []
    for f in files:
        try:
            part = pd.read_parquet(f)
        except Exception as exc:
            raise DataSourceError(f"cannot read {f}: {exc}") from exc
        absent = {"text", "label"} - set(part.columns)
        if absent:
            raise DataSourceError(f"{f} lacks column(s) {sorted(absent)}; expected `text` and `label`")
        parts.append(part[["text", "label"]])
    return pd.concat(parts, ignore_index=True)


def _load_aclimdb(directory: Path) -> pd.DataFrame:
    root = directory / "aclImdb" if (directory / "aclImdb").is_dir() else directory
    rows: list[tuple[str, int]] = []
    for split in ("train", "test"):
        for sub, label in (("neg", 0), ("pos", 1)):
            folder = root / split / sub
            if not folder.is_dir():
                raise DataSourceError(f"aclImdb folder {folder} not found. {_hint(directory)}")
            rows.extend((f.read_text(encoding="utf-8"), label) for f in sorted(folder.glob("*.txt")))
    return pd.DataFrame(rows, columns=["text", "label"])


# ------------------------------------------------------------------------------ cleaning & split
@dataclass(frozen=True)
class SplitReport:
    """What preparing the splits did, for metrics and MLflow."""

    source_rows: int
    duplicates_dropped: int
    conflicting_dropped: int
    sizes: dict[str, int]
    positive_share: dict[str, float]


def make_splits(frame: pd.DataFrame, params: DataParams) -> tuple[dict[str, pd.DataFrame], SplitReport]:
    """Clean, deduplicate, shuffle with the seed and cut the 35k/5k/rest reference split; with
    `data.transfer_reviews`, also the unlabelled `transfer` split (text only) from the train split's unused part."""
    check_frame(frame, "source")
    df = pd.DataFrame({"text": frame["text"].map(clean_text), "label": frame["label"].astype(int)})
    n0 = len(df)
    # A text seen with both labels cannot be trusted in any split: drop every copy of it.
    conflicting = df.groupby("text")["label"].transform("nunique") > 1
    n_conflicting = int(conflicting.sum())
    df = df[~conflicting]
    before = len(df)
    df = df.drop_duplicates("text", keep="first").reset_index(drop=True)
    n_dups = before - len(df)

    need = params.train_count + params.val_count + 1
    if len(df) < need:
        raise DataValidationError(
            f"only {len(df)} unique labelled reviews; train_count + val_count + a test set need {need}"
        )
    order = np.random.default_rng(params.seed).permutation(len(df))
    df = df.iloc[order].reset_index(drop=True)
    t, v = params.train_count, params.val_count
    end = len(df) if params.test_count is None else min(len(df), t + v + params.test_count)
    splits = {"train": df.iloc[:t], "val": df.iloc[t : t + v], "test": df.iloc[t + v : end]}
    subs = {"train": params.train_subsample, "val": params.val_subsample, "test": params.test_subsample}
    unused_train = splits["train"][["text"]]  # the label column goes before any row of it is drawn
    splits = {k: _stratified_subsample(s, subs[k], params.seed) for k, s in splits.items()}
    transfer = draw_transfer_reviews(unused_train.drop(index=splits["train"].index), params)
    splits = {k: s.reset_index(drop=True) for k, s in splits.items()}
    validate_splits(splits)
    report = SplitReport(
        source_rows=n0,
        duplicates_dropped=n_dups,
        conflicting_dropped=n_conflicting,
        sizes={k: len(s) for k, s in splits.items()} | ({TRANSFER: len(transfer)} if transfer is not None else {}),
        positive_share={k: round(float(s["label"].mean()), 4) for k, s in splits.items()},
    )
    if transfer is not None:
        validate_transfer(transfer, splits)
        splits[TRANSFER] = transfer
    return splits, report


def draw_transfer_reviews(unused: pd.DataFrame, params: DataParams) -> pd.DataFrame | None:
    """At most `data.transfer_reviews` texts drawn uniformly from the train-split reviews the subsample left out.

    `unused` holds the text column only: the draw cannot be stratified, weighted or filtered by a gold label,
    so the distill stage sees these reviews exactly as an unlabelled corpus."""
    if params.transfer_reviews == 0:
        return None
    if len(unused) < params.transfer_reviews:
        log.warning("data.transfer_reviews=%d but only %d train-split reviews lie outside data.train_subsample: "
                    "taking those", params.transfer_reviews, len(unused))
    if len(unused) == 0:
        return None
    drawn = unused.sample(n=min(params.transfer_reviews, len(unused)), random_state=params.seed + 1)
    return drawn.reset_index(drop=True)


def validate_transfer(transfer: pd.DataFrame, splits: dict[str, pd.DataFrame]) -> None:
    """The unlabelled transfer reviews carry no label column and share no review with a labelled split."""
    if list(transfer.columns) != ["text"]:
        raise DataValidationError(f"{TRANSFER}: expected only a text column, found {list(transfer.columns)}")
    labelled = {text_digest(t) for df in splits.values() for t in df["text"]}
    shared = sum(text_digest(t) in labelled for t in transfer["text"])
    if shared:
        raise DataValidationError(f"leakage: {shared} {TRANSFER} review(s) also sit in a labelled split")


def _stratified_subsample(df: pd.DataFrame, n: int | None, seed: int) -> pd.DataFrame:
    if n is None or n >= len(df):
        return df
    from sklearn.model_selection import train_test_split

    kept, _ = train_test_split(df, train_size=n, stratify=df["label"], random_state=seed)
    return kept.sort_index()


def check_frame(df: pd.DataFrame, name: str) -> None:
    """Schema, label and empty-text rules for one frame."""
    absent = {"text", "label"} - set(df.columns)
    if absent:
        raise DataValidationError(f"{name}: missing column(s) {sorted(absent)}")
    bad_labels = sorted(set(pd.unique(df["label"])) - set(LABELS))
    if bad_labels:
        raise DataValidationError(f"{name}: labels must be 0/1, found {bad_labels[:10]}")
    text = df["text"]
    empty = text.isna() | (text.astype(str).str.strip() == "")
    if empty.any():
        raise DataValidationError(f"{name}: {int(empty.sum())} empty review(s), first at row {int(empty.idxmax())}")


def text_digest(text: str) -> str:
    """Stable identity of a cleaned review, used to prove no review sits in two splits."""
    return hashlib.sha1(text.encode("utf-8")).hexdigest()


def validate_splits(splits: dict[str, pd.DataFrame]) -> None:
    """Every split passes `check_frame`, and no review appears in two splits."""
    seen: dict[str, str] = {}
    for name, df in splits.items():
        check_frame(df, name)
        if len(df) == 0:
            raise DataValidationError(f"{name}: split is empty")
        for digest in map(text_digest, df["text"]):
            other = seen.setdefault(digest, name)
            if other != name:
                raise DataValidationError(f"leakage: a review is in both '{other}' and '{name}'")
