"""The seed-recipe benchmark's rows: one name per configuration, whether or not torch.compile is available."""

from __future__ import annotations

import pytest

from benchmarks.seed_recipe import NO_CUDNN_SDPA, runs


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_eager_recipe_keeps_its_name_without_compile(device):
    names = [name for name, _ in runs(False, device)]
    assert "pipeline-recipe-eager" in names and "pipeline-recipe" not in names
    assert all(not settings.get("compile") for _, settings in runs(False, device))


def test_compiled_rows_are_added_when_compile_works():
    rows = dict(runs(True, "cuda"))
    assert rows["pipeline-recipe"]["compile"] is True and rows["pipeline-recipe-eager"]["compile"] is False
    assert rows["pipeline-recipe"]["bucketing"] and rows["pipeline-recipe"]["pad_to_multiple_of"] == 8
    assert len(rows) == len(runs(True, "cuda"))  # no name used twice


def test_the_eager_attention_probes_exist_on_cuda_only():
    cuda = dict(runs(True, "cuda"))
    assert cuda["pipeline-recipe-eager-pad64"]["pad_to_multiple_of"] == 64
    assert cuda[NO_CUDNN_SDPA] == cuda["pipeline-recipe-eager"]  # same settings; only the attention backend differs
    assert not {"pipeline-recipe-eager-pad64", NO_CUDNN_SDPA} & {name for name, _ in runs(True, "cpu")}


@pytest.mark.parametrize(("cpu_precision", "half_rows"), [("32-true", []), ("bf16-mixed", ["lightning-bf16-mixed"])])
def test_a_cpu_times_half_precision_only_where_it_is_native(cpu_precision, half_rows):
    """On a CPU without native bf16 (`auto` resolves to 32-true) no row times emulated bf16, and the recipe trains
    in 32-true, as the finetune stage would there."""
    rows = dict(runs(False, "cpu", cpu_precision))
    assert [name for name in rows if name.startswith("lightning-") and name != "lightning-32-true"] == half_rows
    assert rows["pipeline-recipe-eager"]["precision"] == cpu_precision


def test_cuda_graph_rows_replay_the_fixed_and_the_padded_to_64_shapes_on_cuda_only():
    """`+cudagraphs` rows are their compiled twins in torch.compile's `reduce-overhead` mode, nothing else changed."""
    cuda = dict(runs(True, "cuda"))
    for twin in ("lightning-16-mixed+compile", "pipeline-recipe-pad64"):
        graphs = cuda[twin.replace("+compile", "") + "+cudagraphs"]
        assert graphs == {**cuda[twin], "compile_mode": "reduce-overhead"}
    assert not [name for name, _ in runs(True, "cpu") if "cudagraphs" in name]
    assert not [name for name, _ in runs(False, "cuda") if "cudagraphs" in name]  # nothing compiles without compile
