"""The `int8-pruned` variant: built from the pruned tiny BERT, described, or recorded as skipped; prune's settings."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipeline.core.params import Params, PruneParams
from tests.factories import weight_format_here


def test_params_validated():
    from pipeline.core.params import ParamsError

    with pytest.raises(ParamsError, match=r"prune\.heads"):
        PruneParams(heads=0)
    with pytest.raises(ParamsError, match=r"prune\.damp"):
        PruneParams(damp=0.0)


@pytest.mark.slow  # the opt-in prune stage's whole build (the default profile leaves it off): `make test-all`
def test_pruned_variant_built_and_described(tmp_path, tiny_model_dir, tokenized_dir):
    """Pruned, fused and quantized as described, exported at `export.opset` (17 here, the default 18)."""
    import onnx

    from pipeline.core.params import ExportParams
    from pipeline.runtimes.base import pad_batch
    from pipeline.runtimes.registry import load_runner
    from pipeline.variants.onnx_census import matmul_census
    from pipeline.variants.prune import run_prune

    out = tmp_path / "int8-pruned"
    params = Params(prune=PruneParams(enabled=True, heads=1, ffn_width=64, calibration_samples=32),
                    export=ExportParams(opset=17))
    report = run_prune(finetuned=tiny_model_dir, tokenized=tokenized_dir, variants_root=tmp_path, all_params=params,
                       weight_format=weight_format_here())
    info = json.loads((out / "variant.json").read_text())
    assert info["status"] == "ok" and info["name"] == "int8-pruned"
    assert info["params"]["heads"] == 1 and info["params"]["ffn_width"] == 64
    # the 1-head attention still fuses; the [CLS]-readout last layer stays plain MatMuls
    assert report["fusions"].get("Attention") == 1 and report["cls_readout"] is True
    assert matmul_census(out / "model.onnx")["int8_matmuls"] > 0
    assert {o.domain: o.version for o in onnx.load(out / "model.onnx").opset_import}[""] == 17
    assert (out / "tokenizer.json").is_file() and (out / "pipeline.json").is_file()
    ids, mask = pad_batch([np.arange(5, 25), np.arange(5, 15)], 0)
    logits = load_runner(out)(ids, mask)
    assert logits.shape == (2, 2) and np.isfinite(logits).all()


def test_disabled_pruning_is_recorded_as_skipped(tmp_path, tiny_model_dir, tokenized_dir):
    from pipeline.variants.prune import run_prune

    out = tmp_path / "int8-pruned"
    report = run_prune(finetuned=tiny_model_dir, tokenized=tokenized_dir, variants_root=tmp_path,
                       all_params=Params(prune=PruneParams(enabled=False)), weight_format=weight_format_here())
    info = json.loads((out / "variant.json").read_text())
    assert report["status"] == info["status"] == "skipped"
    assert info["reason"] == "prune.enabled is false"
