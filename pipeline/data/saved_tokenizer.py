"""The tokenizer saved beside a model or variant, read with the `tokenizers` library alone.

Inference asks three things of a tokenizer: the ids of a cleaned text without special tokens
(`pipeline.data.tokens.encode_texts` puts [CLS] and [SEP] around its own truncation window), and the [CLS], [SEP]
and padding ids. A fast tokenizer's `tokenizer.json` holds its whole pipeline (normalizer, pre-tokenizer,
vocabulary, added tokens), and transformers' fast tokenizers encode with this same library on that file; reading
it directly gives the same ids (tests/unit/data/test_saved_tokenizer.py compares them on real reviews and generated
text) without importing transformers, which imports torch. A server, TorchServe worker or Spark executor that scores
an ONNX or OpenVINO variant then loads neither (docs/serving.md has what that saves at start-up).

Where a directory has no `tokenizer.json` (a tokenizer without a fast version), `pipeline.modeling.
load_saved_tokenizer` falls back to transformers' `AutoTokenizer`."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"


class SavedTokenizer:
    """`tokenizer.json` of a saved directory, with its stored truncation and padding switched off (transformers
    writes the last call's settings into the file; the pipeline truncates and pads itself). Safe to call from many
    threads: the settings are fixed here, and encoding only reads them."""

    def __init__(self, backend: Any, cls_token_id: int | None, sep_token_id: int | None,
                 pad_token_id: int | None) -> None:
        self.backend = backend
        self.cls_token_id = cls_token_id
        self.sep_token_id = sep_token_id
        self.pad_token_id = pad_token_id

    @classmethod
    def from_dir(cls, directory: str | Path) -> SavedTokenizer | None:
        """The tokenizer of `directory`; None where it has no `tokenizer.json`. The special tokens are the ones
        its `tokenizer_config.json` names (BERT's `[CLS]`, `[SEP]` and `[PAD]` where it names none)."""
        from tokenizers import Tokenizer

        d = Path(directory)
        if not (d / TOKENIZER_FILE).is_file():
            return None
        backend = Tokenizer.from_file(str(d / TOKENIZER_FILE))
        backend.no_truncation()
        backend.no_padding()
        config = json.loads((d / TOKENIZER_CONFIG).read_text()) if (d / TOKENIZER_CONFIG).is_file() else {}

        def token_id(key: str, default: str) -> int | None:
            token = config.get(key, default)
            if isinstance(token, dict):  # an AddedToken as transformers serialises it
                token = token.get("content")
            return None if token is None else backend.token_to_id(str(token))

        return cls(backend, token_id("cls_token", "[CLS]"), token_id("sep_token", "[SEP]"),
                   token_id("pad_token", "[PAD]"))

    def __call__(self, texts: Sequence[str], add_special_tokens: bool = False, truncation: bool = False,
                 verbose: bool = False) -> dict[str, list[list[int]]]:
        """`{"input_ids": [...]}` for `texts`, as a transformers tokenizer answers the same call (the part of its
        interface `pipeline.data.tokens` uses). Truncation is `pipeline.data.tokens.truncate_ids`'s job."""
        if truncation:
            raise ValueError("SavedTokenizer does not truncate: pipeline.data.tokens.truncate_ids does")
        encodings = self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return {"input_ids": [e.ids for e in encodings]}

    def ids_and_words(self, texts: Sequence[str]) -> list[tuple[list[int], list[int | None]]]:
        """Each text's ids without special tokens and, for each id, the index of the pre-tokenized word it comes
        from (`pipeline.data.tokens.window_token_ids` drops the word a cut may have split)."""
        return [(e.ids, e.word_ids) for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]
