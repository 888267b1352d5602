"""Unit: the saved tokenizer read by the `tokenizers` library alone gives transformers' ids, special ids and
fallback; a predictor of an ONNX or OpenVINO variant then imports neither transformers nor torch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.data.cleaning import clean_text
from pipeline.data.saved_tokenizer import TOKENIZER_FILE, SavedTokenizer
from pipeline.data.tokens import encode_texts
from pipeline.modeling import load_saved_tokenizer
from tests.factories import ROOT


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """The packaged model's tokenizer as the finetune stage saves it (`save_pretrained`), after a call with
    truncation and padding, whose settings transformers writes into `tokenizer.json`."""
    from pipeline.core.params import ModelParams
    from pipeline.modeling import load_tokenizer

    d = tmp_path_factory.mktemp("saved-tokenizer")
    own = load_tokenizer(ModelParams(source="tiny"))  # not the session's: this call changes its settings
    own(["a call that leaves settings behind"], truncation=True, max_length=16, padding="max_length")
    own.save_pretrained(d)
    assert json.loads((d / TOKENIZER_FILE).read_text())["truncation"]["max_length"] == 16
    return d


@pytest.fixture(scope="module")
def reviews(imdb_dir) -> list[str]:
    texts = pd.read_parquet(imdb_dir / "test.parquet", columns=["text"])["text"].sample(n=400, random_state=5)
    return [clean_text(t) for t in texts]


def hf_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=False, truncation=False, verbose=False)["input_ids"]


def test_real_reviews_get_transformers_ids_and_special_ids(saved, tokenizer, reviews):
    light = load_saved_tokenizer(saved)
    assert isinstance(light, SavedTokenizer)
    assert light(reviews)["input_ids"] == hf_ids(tokenizer, reviews)
    assert max(len(ids) for ids in light(reviews)["input_ids"]) > 16  # the file's stored truncation is off
    assert (light.cls_token_id, light.sep_token_id, light.pad_token_id) == (
        tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.pad_token_id)
    windows = [encode_texts(reviews, t, 64, truncation="head_tail", head_fraction=0.25) for t in (light, tokenizer)]
    assert [w.tolist() for w in windows[0]] == [w.tolist() for w in windows[1]]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.text(min_size=1, max_size=300), min_size=1, max_size=4))
def test_any_text_gets_transformers_ids(saved, tokenizer, texts):
    light = SavedTokenizer.from_dir(saved)
    assert light(texts)["input_ids"] == hf_ids(tokenizer, texts)


def test_the_special_tokens_are_the_ones_the_config_names(saved, tmp_path):
    for f in saved.iterdir():
        shutil.copy(f, tmp_path / f.name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["pad_token"] = {"content": "[MASK]"}  # transformers' serialised AddedToken form
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    light = SavedTokenizer.from_dir(tmp_path)
    assert light.pad_token_id == light.backend.token_to_id("[MASK]") != light.backend.token_to_id("[PAD]")
    with pytest.raises(ValueError, match="truncate"):
        light(["text"], truncation=True)


def test_a_directory_without_tokenizer_json_falls_back_to_transformers(saved, tmp_path, tokenizer, reviews):
    from pipeline.modeling import packaged_model_dir

    for f in saved.iterdir():
        if f.name != TOKENIZER_FILE:
            shutil.copy(f, tmp_path / f.name)
    shutil.copy(packaged_model_dir() / "vocab.txt", tmp_path / "vocab.txt")
    assert SavedTokenizer.from_dir(tmp_path) is None
    fallback = load_saved_tokenizer(tmp_path)
    assert not isinstance(fallback, SavedTokenizer)
    assert hf_ids(fallback, reviews[:20]) == hf_ids(tokenizer, reviews[:20])


@pytest.mark.parametrize("name", ["int8-dynamic", "int8-openvino"])
def test_an_onnx_or_openvino_predictor_imports_neither_transformers_nor_torch(built, name):
    script = ("import sys; from pipeline.deployment.inference import SentimentPredictor; "
              "p = SentimentPredictor(sys.argv[1]); print(p.predict(['a fine film'])[0].label); "
              "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", script, str(built["dirs"][name])], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    label, modules = proc.stdout.strip().splitlines()[-2:]
    assert label in ("positive", "negative") and modules == "[]", proc.stdout


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(st.text(min_size=1, max_size=30), st.sampled_from([" ", "\n", "qzxv" * 30, "e\u0301"])),
                max_size=200), st.sampled_from(["head", "head_tail"]))
def test_the_windowed_ids_of_a_long_text_are_the_whole_texts_with_the_saved_tokenizer(saved, tokenizer, pieces,
                                                                                       mode):
    """What servers tokenize with (`SavedTokenizer`) cuts a long text by its word ids as a transformers tokenizer
    does: the same window as the whole text's tokenization truncated."""
    from pipeline.data.tokens import truncate_ids, window_token_ids

    light, text = SavedTokenizer.from_dir(saved), "".join(pieces)
    whole = truncate_ids(hf_ids(tokenizer, [text])[0], 16, mode, 0.25, tokenizer.cls_token_id,
                         tokenizer.sep_token_id)
    assert window_token_ids([text], light, 16, truncation=mode, head_fraction=0.25, first_span=8) == [whole]
