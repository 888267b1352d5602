"""`int8-qat-openvino`: quantization-aware training through NNCF's own quantizers, OpenVINO's documented QAT flow.

`nncf.quantize` on the PyTorch model (int8-openvino's transformer preset, on the same calibration batches) puts fake
quantizers where OpenVINO's INT8 kernels will run, with int8-openvino's post-training ranges; a short finetune
distilled from the FP32 model (`pipeline.training.qat.fake_quantized_finetune`) then trains the weights and the
quantizers' ranges together; `ov.convert_model` turns each fake quantizer into OpenVINO's INT8 `FakeQuantize`, so
the variant runs on the kernels int8-openvino runs on. int8-qat's model, trained for onnxruntime's scheme, lost
that adaptation on the way to OpenVINO (docs/tried-and-dropped.md): QAT has to train through the quantizers of
the runtime that serves it.

NNCF's fake quantizers run as NNCF's own PyTorch reference operations, eagerly (`use_torch_quantizers`), not as
the C++ extension NNCF would compile on first use: little or no faster for this model's QAT, and the compile cost
every fresh machine both cores, a C++ toolchain and a build lock a killed compile left behind (docs/variants.md)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.core.params import QuantizeParams, TrainParams
from pipeline.runtimes.eager import logits_module
from pipeline.variants.onnx_int8 import QuantizeError
from pipeline.variants.openvino_int8 import save_openvino, sdpa_copy, two_row_example

log = logging.getLogger(__name__)

#: The checkpoint job of int8-qat-openvino's finetune (`train.checkpoint_dir/qat-openvino`); the stage clears it
#: once the variant is published.
CHECKPOINT_JOB = "qat-openvino"


def _tensors(batch: tuple[np.ndarray, np.ndarray]) -> tuple[Any, Any]:
    import torch

    return tuple(torch.from_numpy(np.asarray(a, dtype=np.int64)) for a in batch)  # type: ignore[return-value]


def fake_quantized(model: Any, batches: list[tuple[np.ndarray, np.ndarray]]) -> tuple[Any, Any]:
    """(NNCF's fake-quantized copy of `model`, the FP32 copy it started from), both positional
    `(input_ids, attention_mask) -> logits` modules over `sdpa_copy(model)`; `batches` are int8-openvino's
    calibration batches (`calibration_batches`)."""
    try:
        import nncf
    except ImportError as exc:
        raise QuantizeError(f"int8-qat-openvino needs nncf (requirements.txt): {exc}") from exc
    import copy

    use_torch_quantizers()
    fp32 = logits_module(sdpa_copy(model)).eval()
    quantized = nncf.quantize(copy.deepcopy(fp32), nncf.Dataset(batches, _tensors),
                              model_type=nncf.ModelType.TRANSFORMER, subset_size=len(batches))
    shared = share_duplicate_quantizers(quantized, batches[0])
    log.info("int8-qat-openvino: %d of NNCF's quantizers duplicated another on the same tensor; they share it now",
             shared)
    return quantized, fp32.requires_grad_(False)


def _quantizer_slots(quantized: Any) -> list[tuple[Any, str, str, Any]]:
    """(hook store, key, index, quantizer) of every NNCF quantizer hooked into `quantized`, in hook order."""
    from nncf.torch.quantization.layers import BaseQuantizer

    hooks = quantized.get_submodule("__nncf_hooks")
    return [(store, key, idx, module) for store in (hooks.pre_hooks, hooks.post_hooks)
            for key, group in store.items() for idx, module in group.items() if isinstance(module, BaseQuantizer)]


def shared_quantizers(quantized: Any) -> int:
    """How many of `quantized`'s quantizer slots hold a quantizer an earlier slot holds too."""
    slots = _quantizer_slots(quantized)
    return len(slots) - len({id(module) for *_, module in slots})


def share_duplicate_quantizers(quantized: Any, batch: tuple[np.ndarray, np.ndarray]) -> int:
    """Make every NNCF quantizer that duplicates another (an input equal to the other's on `batch`, the same class
    and calibrated state) that same module, and return how many slots now share one.

    Why: on PyTorch, SmoothQuant scales the input of each linear layer in that layer's own hook, so a tensor several
    layers read (a layer norm's output, read by query, key and value) gets one fake quantizer per reader. They
    start equal and OpenVINO merges equal ones into one `FakeQuantize`, but QAT trains each apart, and the IR then
    quantizes that activation once per reader, with no INT8 input the projections share. int8-openvino's graph
    (NNCF on OpenVINO IR) has one quantizer there; one shared module gives QAT's IR the same structure, its range
    trained from every reader's gradient."""
    import torch

    slots = _quantizer_slots(quantized)
    seen: dict[int, Any] = {}

    def record(mod: Any, args: tuple[Any, ...]) -> None:  # returns None: a pre-hook's return value replaces the input
        if id(mod) not in seen:
            seen[id(mod)] = args[0].detach().clone()

    handles = [module.register_forward_pre_hook(record) for module in {id(m): m for *_, m in slots}.values()]
    try:
        with torch.no_grad():
            quantized(*_tensors(batch))
    finally:
        for handle in handles:
            handle.remove()

    def same(a: Any, b: Any) -> bool:
        x, y, sa, sb = seen.get(id(a)), seen.get(id(b)), a.state_dict(), b.state_dict()
        return (type(a) is type(b) and x is not None and y is not None and x.shape == y.shape and torch.equal(x, y)
                and sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa))

    owners: list[Any] = []
    for store, key, idx, module in slots:
        owner = next((o for o in owners if o is module or same(o, module)), None)
        if owner is None:
            owners.append(module)
        elif owner is not module:
            store[key][idx] = owner
    return shared_quantizers(quantized)


@contextlib.contextmanager
def embedding_rows_quantized(quantized: Any) -> Iterator[int]:
    """While open, each embedding table of `quantized` whose weight NNCF fake-quantizes per row (symmetric, one
    scale per row: the 8-bit weight quantizer it puts on the word, position and token-type tables) is
    fake-quantized only in the rows the batch looks up, with the same NNCF function and parameters; yields how many
    tables it changed.

    Why: NNCF's hook quantizes the whole weight before the lookup, so every QAT step ran the quantizer forward and
    backward over all 30,522 x 384 entries of the word table (a large share of a step: docs/variants.md) for the few
    thousand rows a batch reads. Per-row scales make the two the same function: each output row is the quantized
    table row (`symmetric_quantize` is elementwise given its row's scale), and the gradients of the table and of its
    scales are zero in every row the batch does not read in both forms, and equal in the rows it does (their sum
    over the occurrences of a row is taken after the quantizer's backward instead of before; `padding_idx` rows
    get none, as before). The quantizer stays registered, so its scale trains, checkpoints and resumes as before;
    on exit NNCF's own hook quantizes the whole table again, as `ov.convert_model` needs it to."""
    import torch
    from nncf.torch.quantization.layers import SymmetricQuantizer
    from nncf.torch.quantization.quantize_functions import symmetric_quantize

    changed: list[tuple[Any, Any, bool]] = []  # (table, its quantizer, whether its scale trains)
    for _, key, _, quantizer in _quantizer_slots(quantized):
        scope, _, port = key.rpartition("__")  # "<module path>/embedding/<call>__1": the lookup's weight argument
        parts = scope.split("/")
        if len(parts) < 3 or parts[-2] != "embedding" or port != "1" or not isinstance(quantizer, SymmetricQuantizer):
            continue
        with contextlib.suppress(AttributeError):
            table = quantized.get_submodule(".".join(parts[:-2]))
            if (isinstance(table, torch.nn.Embedding) and quantizer.is_enabled_quantization()
                    and tuple(quantizer.scale_shape) == (table.num_embeddings, 1)):
                changed.append((table, quantizer, bool(quantizer.scale.requires_grad)))

    def rows(table: Any, quantizer: Any) -> Any:
        def hook(module: Any, args: tuple[Any, ...], looked_up: Any) -> Any:
            scale = torch.nn.functional.embedding(args[0], quantizer.scale, padding_idx=module.padding_idx)
            return symmetric_quantize(looked_up, quantizer.levels, quantizer.level_low, quantizer.level_high,
                                      scale, quantizer.eps)
        return table.register_forward_hook(hook)

    handles = []
    try:
        for table, quantizer, trained in changed:
            quantizer.disable_quantization()  # NNCF's whole-table hook passes the weight through ...
            if trained:
                quantizer.enable_gradients()  # ... and its scale, which that call freezes, still trains here
            handles.append(rows(table, quantizer))
        yield len(changed)
    finally:
        for handle in handles:
            handle.remove()
        for _, quantizer, trained in changed:
            quantizer.enable_quantization()  # which makes its scale trainable: as it was, or frozen again
            if not trained:
                quantizer.disable_gradients()


def use_torch_quantizers() -> None:
    """Make NNCF run its CPU fake quantizers (forward and backward) as its PyTorch reference operations, eagerly,
    instead of compiling and loading its C++ extension.

    Why: on this model the extension trains little or no faster than the reference operations (docs/variants.md
    has the measurements), while compiling it takes both cores of a fresh machine, needs a C++ toolchain, and a
    compile killed midway leaves PyTorch's build lock for every later run to wait on.
    NNCF's own fallback, `ReferenceQuantizedFunctions`, wraps the same two functions in `torch.compile`: another
    compile, per input shape. NNCF has no public switch: its CPU namespace (`QuantizedFunctionsCPU`) loads the
    extension on the first `get` unless it holds a namespace already, so this gives it one. nncf is pinned
    (requirements.txt); a release without that attribute stops the build here instead of compiling."""
    from types import SimpleNamespace

    from nncf.torch.quantization.extensions import QuantizedFunctionsCPU
    from nncf.torch.quantization.reference import torch_executor

    if not hasattr(QuantizedFunctionsCPU, "_loaded_namespace"):
        raise QuantizeError("this nncf release no longer keeps its CPU quantizer namespace in `_loaded_namespace`: "
                            "int8-qat-openvino cannot put NNCF's PyTorch reference quantizers in place of its C++ "
                            "extension (pipeline.variants.openvino_qat.use_torch_quantizers)")
    QuantizedFunctionsCPU._loaded_namespace = SimpleNamespace(Quantize_forward=torch_executor.forward,
                                                              Quantize_backward=torch_executor.backward)


def to_openvino(quantized: Any, example: tuple[np.ndarray, np.ndarray]) -> Any:
    """The trained fake-quantized module as an OpenVINO model, batch and length dynamic, inputs named as every
    variant's. `ov.convert_model` traces it with torch.jit (`QAT_TRACE_DEPRECATION` says why); the result is
    checked against the module (`parity`), so the tracer's warnings are silenced (`checked_trace`)."""
    import openvino as ov
    import torch

    from pipeline.runtimes.torchscript import QAT_TRACE_DEPRECATION, checked_trace

    ids, mask = two_row_example(example)
    dynamic = ov.PartialShape([-1, -1])
    with torch.no_grad(), checked_trace(QAT_TRACE_DEPRECATION):
        return ov.convert_model(quantized.eval(), example_input=(ids, mask),
                                input=[("input_ids", dynamic, ov.Type.i64), ("attention_mask", dynamic, ov.Type.i64)])


def parity(quantized: Any, ir: Path, seqs: list[np.ndarray], pad_id: int) -> dict[str, Any]:
    """How closely the saved IR, run as it is served (`OpenVinoRunner`), reproduces the trained fake-quantized module
    on one padded batch of `seqs` (`pipeline.variants.export.parity`): PyTorch emulates INT8 in float, OpenVINO
    runs INT8 kernels (with its float layers in its own precision), so logits differ by rounding; the labels should
    not (both are recorded, neither is enforced here: the evaluate stage measures the IR against FP32)."""
    from pipeline.runtimes.eager import TorchRunner
    from pipeline.runtimes.openvino import OpenVinoRunner
    from pipeline.variants.export import parity as logits_parity

    p = logits_parity(TorchRunner(quantized.eval()), OpenVinoRunner(ir), seqs, pad_id)
    return {"parity_batch": p.batch, "parity_max_abs_diff": round(p.max_abs_diff, 5),
            "parity_label_agreement": p.label_agreement}


@dataclass(frozen=True, kw_only=True)
class QatJob:
    """What one int8-qat-openvino build trains on and with."""

    params: QuantizeParams  # the QAT settings (`qat_openvino_*`, `qat_epochs`, `qat_batch_size`, `qat_distillation`)
    train: TrainParams  # the seed and where checkpoints go (`checkpoint_dir`, `resume`)
    finetuned: Path  # the model trained from: a checkpoint of another model's QAT is never resumed
    pad_id: int
    calibration: list[tuple[np.ndarray, np.ndarray]]  # int8-openvino's calibration batches
    reviews: list[np.ndarray]  # QAT's training reviews (in the training window) and their labels
    labels: np.ndarray
    check_reviews: list[np.ndarray]  # validation reviews the IR is checked against the trained module on


def qat_openvino(graph: Any, job: QatJob, out: Path) -> dict[str, Any]:
    """Build int8-qat-openvino from `graph` (the finetuned model as int8-openvino converts it, a fresh copy: its
    weights are trained) into `out` and return its record. The QAT checkpoints and resumes under
    `train.checkpoint_dir/qat-openvino` like the other training jobs (`qat_checkpoints`: a resumed run rebuilds the
    fake-quantized model from the same inputs, then loads the checkpoint into it)."""
    import nncf

    from pipeline.core.io import token_fingerprint
    from pipeline.runtimes.torchscript import QAT_TRACE_DEPRECATION
    from pipeline.training.qat import QatRun, fake_quantized_finetune, qat_checkpoints
    from pipeline.variants import export, openvino_int8

    q = job.params
    quantized, fp32 = fake_quantized(graph, job.calibration)
    settings = {"qat_epochs": q.qat_epochs, "qat_batch_size": q.qat_batch_size, "qat_lr": q.qat_openvino_lr,
                "qat_distillation": q.qat_distillation, "qat_precision": q.trainer_precision(),
                "nncf": nncf.__version__,
                "calibration": token_fingerprint([ids for ids, _ in job.calibration]),
                "reviews": token_fingerprint(job.reviews), "labels": token_fingerprint([job.labels])}
    # what builds the model that trains: nncf.quantize's call here, the SDPA copy, the graph int8-openvino converts
    code = [Path(__file__), Path(openvino_int8.__file__), Path(export.__file__)]
    store, plan = qat_checkpoints(job.train, CHECKPOINT_JOB, settings, quantized, [job.finetuned], code=code,
                                  quantize=q)
    run = QatRun(reviews=job.reviews, labels=job.labels, params=q, lr=q.qat_openvino_lr, seed=job.train.seed,
                 pad_id=job.pad_id, store=store, plan=plan)
    with embedding_rows_quantized(quantized) as tables:
        log.info("int8-qat-openvino: %d embedding tables fake-quantized in the rows each batch reads", tables)
        steps, loss = fake_quantized_finetune(quantized, fp32 if q.qat_distillation > 0 else None, run)
    record = save_openvino(to_openvino(quantized, job.calibration[-1]), out)
    check = parity(quantized, out / "model.xml", job.check_reviews, job.pad_id)
    log.info("int8-qat-openvino: the IR against the trained fake-quantized module on %d validation reviews: "
             "max |logit diff| %.4g, label agreement %.3f", check["parity_batch"], check["parity_max_abs_diff"],
             check["parity_label_agreement"])
    return {"method": "QAT through NNCF's quantizers (nncf.quantize on PyTorch, model_type=TRANSFORMER) + "
                      "ov.convert_model (OpenVINO IR)",
            "fake_quantizers": "NNCF's PyTorch reference operations, eager (no C++ extension compiled)",
            **record, "source": "the finetuned model with SDPA attention, as int8-openvino converts it",
            "calibration_batches": len(job.calibration), "shared_quantizers": shared_quantizers(quantized),
            **run.record(steps, loss), **check,
            "deprecated_api": QAT_TRACE_DEPRECATION}
