"""Raw text in, label and probability out, for any variant directory.

The serving handler, the behaviour tests and the benchmarks all use this class, so a review is cleaned,
tokenized and truncated exactly as in training (the rules come from the variant's `pipeline.json`).
It does not depend on TorchServe."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.data.tokens import clip_chars, encode_texts
from pipeline.deployment.coalescing import MAX_BATCH_TEXTS, Coalescer
from pipeline.runtimes.base import length_order, pad_batch
from pipeline.runtimes.record import VARIANT_FILE, read_variant
from pipeline.runtimes.registry import load_runner


@dataclass(frozen=True)
class Prediction:
    """One review's answer: the label and the probability of that label."""

    label: str
    score: float


def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax, stable for large logits."""
    z = logits - logits.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


class SentimentPredictor:
    """Loads a variant (or the finetuned HF directory) once and predicts any number of raw texts; safe to call
    from many threads at once.

    `max_chars` (None = no cap) cuts each text to that many characters, head and tail kept as in training,
    before the tokenizer sees it, so a huge text costs a bounded amount of tokenizer time and memory.
    `predict` takes any number of texts: they are tokenized `CHUNK_TEXTS` at a time (bounded memory) and scored
    in batches of at most `max_batch`, each of reviews of similar length (`score`, which any caller of token ids
    goes through, so no input makes a forward pass larger than that). Concurrent calls share the runner
    through a `Coalescer`: reviews of callers that arrive while a batch runs are scored together in the next one
    (`pipeline.deployment.coalescing`), which changes no answer."""

    #: Texts tokenized at once by `predict`: bounds the token ids held in memory for a long input.
    CHUNK_TEXTS = 2048

    def __init__(self, directory: str | Path, threads: int | None = None, max_chars: int | None = None,
                 max_batch: int = MAX_BATCH_TEXTS, **runner_options: Any) -> None:
        from pipeline.modeling import load_saved_tokenizer, pad_id, read_model_record

        self.directory = Path(directory)
        self.max_chars = max_chars
        meta = read_model_record(self.directory)
        self.preprocessing = meta["preprocessing"]
        self.labels = {int(k): v for k, v in meta["labels"].items()}
        self.tokenizer = load_saved_tokenizer(self.directory)
        self.pad_id = pad_id(self.tokenizer)
        self.runner = load_runner(self.directory, threads, **runner_options)
        self.name = (read_variant(self.directory).name if (self.directory / VARIANT_FILE).is_file()
                     else "fp32-eager")
        self.max_batch = max_batch
        self.coalescer: Coalescer[Prediction] = Coalescer(self._score_batch, max_batch)
        # the tokenizer's settings are fixed by its first call (no truncation, no padding); making that call here
        # means concurrent callers only ever read them
        self.encode(["warm-up"])

    def encode(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Token ids with the training-time cleaning and truncation."""
        if not texts:
            return []  # the tokenizer refuses an empty batch
        p = self.preprocessing
        return encode_texts([self.clipped(t) for t in texts], self.tokenizer, p["max_length"],
                            truncation=p["truncation"], head_fraction=p["head_fraction"])

    def clipped(self, text: str) -> str:
        """`text` as the model reads it before tokenizing: cut to `max_chars` characters, head and tail kept."""
        if self.max_chars is None:
            return text
        return clip_chars(text, self.max_chars, self.preprocessing["truncation"], self.preprocessing["head_fraction"])

    def predict(self, texts: Sequence[str], progress: bool | None = False) -> list[Prediction]:
        """Predictions in input order for any number of texts, tokenized `CHUNK_TEXTS` at a time and scored by
        `score`. `progress`: a progress bar over the chunks (None: only on a terminal, and only for more than one)."""
        if len(texts) <= self.CHUNK_TEXTS:
            return self.score(self.encode(texts))
        starts = range(0, len(texts), self.CHUNK_TEXTS)
        if progress is not False:
            from tqdm.auto import tqdm

            # tqdm's disable=None: shown on a terminal only
            starts = tqdm(starts, desc=f"scoring {len(texts)} texts", unit="chunk",
                          disable=None if progress is None else False)
        out: list[Prediction] = []
        for start in starts:
            out.extend(self.score(self.encode(texts[start : start + self.CHUNK_TEXTS])))
        return out

    def score(self, encoded: Sequence[np.ndarray]) -> list[Prediction]:
        """Predictions for token ids from `encode`, in order, for any number of sequences: sorted by length and
        scored in padded batches of at most `max_batch` (so no caller, however many texts it hands over at once,
        makes one forward pass larger than that), each merged with other threads' concurrent calls
        (`Coalescer`). The TorchServe handler tokenizes each request of a frontend batch on its own and scores
        the survivors together through here."""
        if len(encoded) <= self.max_batch:
            return self.coalescer(encoded)
        order = length_order(encoded).tolist()  # similar lengths share a batch
        answers: dict[int, Prediction] = {}
        for first in range(0, len(order), self.max_batch):
            idx = order[first : first + self.max_batch]
            answers.update(zip(idx, self.coalescer([encoded[i] for i in idx]), strict=True))
        return [answers[i] for i in range(len(encoded))]

    def _score_batch(self, encoded: Sequence[np.ndarray]) -> list[Prediction]:
        if not encoded:
            return []
        ids, mask = pad_batch(list(encoded), self.pad_id)
        probs = softmax(self.runner(ids, mask).astype(np.float64))
        best = probs.argmax(-1)
        return [Prediction(self.labels[int(i)], float(probs[row, i])) for row, i in enumerate(best)]


class ContractPredictor(SentimentPredictor):
    """`SentimentPredictor` that refuses what is not a review (`pipeline.deployment.protocol.check_text`): the
    MLflow pyfunc runs it, so a null, a number, a blank or invisible text is a `RequestError` naming its row,
    never a label scored from `str(value)`, however the model is served or loaded.

    It takes any number of rows of any length (a long text is cut to `max_chars`, head and tail, as the served
    model does): how many texts a request may hold and how long each may be are the servers' limits
    (`pipeline.deployment.protocol.Limits`, checked before a request reaches the model), not the model's, so
    `mlflow models predict`, a notebook or a Spark job scores a whole corpus."""

    def predict(self, texts: Sequence[Any], progress: bool | None = None) -> list[Prediction]:
        """Predictions for `texts` once each passed the contract's checks of a text (`RequestError` otherwise); a
        text longer than `max_chars` passes them in the part the model reads too (its head and tail)."""
        from pipeline.deployment.protocol import TEXT_COLUMN, RequestError, check_text

        checked = []
        for i, value in enumerate(texts):
            where = f"{TEXT_COLUMN}[{i}]"
            text = check_text(value, where)
            if len(clipped := self.clipped(text)) < len(text):
                try:
                    check_text(clipped, where)
                except RequestError:
                    raise RequestError(400, f"{where} has {len(text)} characters and nothing to score in the "
                                            f"{self.max_chars} the model reads (its head and tail)") from None
            checked.append(text)
        return super().predict(checked, progress)


def freeze_loaded_objects() -> None:
    """Move every object alive now (the loaded model, tokenizer and libraries, kept for the server's life) into
    the garbage collector's permanent generation (`gc.freeze`), so the collections a request's own allocations set
    off never traverse them: a body of many small JSON containers, parsed before it is refused, otherwise triggers
    full collections over every object of the model. Servers call it once, after loading and warming up."""
    import gc

    gc.collect()  # what loading left unreachable is freed first, not kept for good
    gc.freeze()
