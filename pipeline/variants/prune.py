"""The `prune` stage's work: `int8-pruned`, the finetuned model pruned (`pipeline.surgery.prune`), exported with the
[CLS] readout, fused and quantized like `int8-dynamic`."""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path
from typing import Any

from pipeline.core.machine import Choice
from pipeline.core.params import Params, to_dict
from pipeline.data.tokens import draw_rows, read_tokenized, training_window
from pipeline.modeling import load_finetuned, pad_id
from pipeline.runtimes.catalog import built_by, directories
from pipeline.runtimes.record import VariantInfo, building, write_skipped, write_variant

log = logging.getLogger(__name__)


def run_prune(*, finetuned: Path, tokenized: Path, variants_root: Path, all_params: Params,
              weight_format: Choice) -> dict[str, Any]:
    """`int8-pruned`: the finetuned model with whole heads and FFN neurons removed (`prune_encoder`), exported
    with the [CLS] readout (`export.cls_readout`), fused by onnxruntime and quantized like `int8-dynamic`
    (`quantize.per_channel`; `weight_format`: how the stage resolved `quantize.weight_format`). Disabled, it is
    written as a skipped variant."""
    name = "int8-pruned"
    params, quantize = all_params.prune, all_params.quantize
    out = directories(variants_root, built_by("prune"))[name]
    if not params.enabled:
        reason = "prune.enabled is false"
        log.warning("%s skipped: %s", name, reason)
        write_skipped(out, VariantInfo.skipped(name, reason, to_dict(params)), finetuned)
        return {"status": "skipped", "reason": reason}
    # torch and the builders only when there is something to prune (the default skips it)
    from pipeline.surgery.prune import calibration_batches, prune_encoder
    from pipeline.variants.export import max_length_of
    from pipeline.variants.fusion import FusionCheck, fused_dynamic_int8

    started = time.perf_counter()
    model, tokenizer, meta = load_finetuned(finetuned)
    pad = pad_id(tokenizer)
    train = read_tokenized(tokenized, "train")
    window = training_window(meta, tokenizer)
    seed = all_params.train.seed + 2
    seqs = [train["input_ids"].iloc[i] for i in draw_rows(len(train), params.calibration_samples, seed)]
    seqs = [window(s) for s in seqs] if window is not None else seqs
    batches = calibration_batches(seqs, batch_size=params.calibration_batch_size, pad_id=pad)
    student, report = prune_encoder(model, batches, params.heads, params.ffn_width, params.damp)

    with building(out) as work, tempfile.TemporaryDirectory(prefix="prune-") as tmp:
        check = FusionCheck.of_model(student, "the pruned model", tokenized=tokenized, max_length=max_length_of(meta),
                                     pad_id=pad, export=all_params.export)
        built = fused_dynamic_int8(student, name, work, check, export=all_params.export,
                                   per_channel=quantize.per_channel, weight_format=weight_format, tmp=Path(tmp))
        info = {"method": "structured pruning (OBS selection + least-squares repair) + onnxruntime.quantize_dynamic",
                **to_dict(params), **built, **report,
                "build_seconds": round(time.perf_counter() - started, 2)}
        write_variant(work, VariantInfo.built(name, info), finetuned)
    return info
