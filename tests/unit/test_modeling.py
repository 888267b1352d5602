"""Unit: model sources and heads (tiny models built from configs, no download)."""

from __future__ import annotations

import pytest
import torch

from pipeline.core.params import DataParams, ModelParams, TrainParams
from pipeline.modeling import MEAN_POOL_MODEL_TYPE, ModelSourceError, load_finetuned, load_model
from pipeline.training.loop import save_model


def test_mean_head_ignores_padding():
    model = load_model(ModelParams(source="tiny", head="mean"), seed=0).eval()
    ids = torch.randint(1000, 2000, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    with torch.no_grad():
        padded = model(input_ids=ids, attention_mask=mask).logits[1]
        alone = model(input_ids=ids[1:, :7], attention_mask=mask[1:, :7]).logits[0]
    assert torch.allclose(padded, alone, atol=1e-5)
    assert not hasattr(model.bert, "pooler") or model.bert.pooler is None  # no unused [CLS] pooler weights


def test_mean_head_round_trips_with_its_own_model_type(tmp_path, tokenizer):
    model = load_model(ModelParams(source="tiny", head="mean"), seed=0).eval()
    save_model(model, tokenizer, tmp_path, DataParams(max_length=64), ModelParams(source="tiny", head="mean"),
               TrainParams())
    assert f'"model_type": "{MEAN_POOL_MODEL_TYPE}"' in (tmp_path / "config.json").read_text()
    loaded, _, meta = load_finetuned(tmp_path)
    assert type(loaded).__name__ == type(model).__name__ and meta["params"]["model"]["head"] == "mean"
    ids = torch.randint(1000, 2000, (3, 9))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


def test_mean_head_refuses_non_bert_encoders(tmp_path):
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    cfg = DistilBertConfig(vocab_size=100, dim=32, hidden_dim=64, n_layers=1, n_heads=2)
    DistilBertForSequenceClassification(cfg).save_pretrained(tmp_path)
    with pytest.raises(ModelSourceError, match=r"model\.head: mean supports BERT"):
        load_model(ModelParams(source="local", name=str(tmp_path), head="mean"))
    assert type(load_model(ModelParams(source="local", name=str(tmp_path)))).__name__.startswith("DistilBert")


def test_unknown_head_is_a_params_error():
    from pipeline.core.params import ParamsError, section

    with pytest.raises(ParamsError, match=r"model\.head"):
        section({"model": {"head": "max"}}, "model", ModelParams)


def test_attention_dropout_override_reaches_the_layers():
    model = load_model(ModelParams(source="tiny"), seed=0, attention_dropout=0.0)
    probs = [m.dropout.p for m in model.modules() if type(m).__name__ == "BertSelfAttention"]
    assert probs == [0.0, 0.0] and model.config.attention_probs_dropout_prob == 0.0
    default = load_model(ModelParams(source="tiny"), seed=0)
    assert default.config.attention_probs_dropout_prob == 0.1


def test_hidden_dropout_override_reaches_every_hidden_state_dropout():
    model = load_model(ModelParams(source="tiny"), seed=0, attention_dropout=0.0, hidden_dropout=0.0)
    attention = {id(m.dropout) for m in model.modules() if type(m).__name__ == "BertSelfAttention"}
    hidden = [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout) and id(m) not in attention]
    assert hidden and set(hidden) == {0.0} and model.config.hidden_dropout_prob == 0.0
    default = load_model(ModelParams(source="tiny"), seed=0)
    assert default.config.hidden_dropout_prob == 0.1
    assert {m.p for m in default.modules() if isinstance(m, torch.nn.Dropout)} == {0.1}


def test_attention_dropout_is_validated():
    from pipeline.core.params import ParamsError, TrainParams, section

    with pytest.raises(ParamsError, match=r"train\.attention_dropout"):
        section({"train": {"attention_dropout": 1.5}}, "train", TrainParams)
    assert section({"train": {"attention_dropout": None}}, "train", TrainParams).attention_dropout is None


def test_pad_id_is_the_tokenizers_own_or_zero(tmp_path, tokenizer):
    from types import SimpleNamespace

    from pipeline.modeling import pad_id, saved_pad_id

    assert pad_id(SimpleNamespace(pad_token_id=None)) == 0
    assert pad_id(SimpleNamespace(pad_token_id=1)) == 1  # RoBERTa pads with 1, not 0
    tokenizer.save_pretrained(tmp_path)
    assert saved_pad_id(tmp_path) == tokenizer.pad_token_id


def test_a_fresh_process_reads_a_mean_head_models_tokenizer_without_a_model_type_warning(tmp_path, tokenizer):
    """`saved_pad_id` (the stages) and the served predictor read the tokenizer beside a saved model; transformers
    looks at its `config.json` first, so the mean-pooling type must be known there too (a fresh process: the type
    registers process-wide, so in this one an earlier test may have registered it already)."""
    import subprocess
    import sys

    model = load_model(ModelParams(source="tiny", head="mean"), seed=0).eval()
    save_model(model, tokenizer, tmp_path, DataParams(max_length=64), ModelParams(source="tiny", head="mean"),
               TrainParams())
    proc = subprocess.run([sys.executable, "-c", "import sys; from pipeline.modeling import saved_pad_id; "
                           "print(saved_pad_id(sys.argv[1]))", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-1] == str(tokenizer.pad_token_id)
    assert MEAN_POOL_MODEL_TYPE not in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("head", ["cls", "mean"])
def test_model_layers_keeps_the_pretrained_encoders_first_layers(head):
    """`model.layers` builds that many transformer layers and loads the checkpoint's first ones into them (the
    packaged all-MiniLM-L6-v2, 6 layers); more layers than the checkpoint has is refused by name."""
    whole = load_model(ModelParams(head=head), seed=0)
    cut = load_model(ModelParams(head=head, layers=2), seed=0)
    assert cut.config.num_hidden_layers == 2 and len(cut.bert.encoder.layer) == 2
    assert len(whole.bert.encoder.layer) == 6
    for kept, source in zip(cut.bert.encoder.layer, whole.bert.encoder.layer[:2], strict=True):
        for (name, a), (_, b) in zip(kept.state_dict().items(), source.state_dict().items(), strict=True):
            assert torch.equal(a, b), name
    assert torch.equal(cut.bert.embeddings.word_embeddings.weight, whole.bert.embeddings.word_embeddings.weight)
    with pytest.raises(ModelSourceError, match=r"model\.layers: 7 is more than the 6 layers"):
        load_model(ModelParams(head=head, layers=7))
    assert len(load_model(ModelParams(source="tiny", layers=1)).bert.encoder.layer) == 1
