"""The PyTorch runtime: an eager (or scripted) module under `inference_mode`, optionally under autocast, on the
device its parameters live on; it loads the finetuned HF directory as `fp32-eager`."""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from pipeline.core.machine import Choice
from pipeline.runtimes.base import checked_options, predict_logits, set_torch_threads
from pipeline.runtimes.fp32_linear import FP32_LINEAR
from pipeline.runtimes.record import VariantInfo

log = logging.getLogger(__name__)
_LOGGED_KERNELS: set[str] = set()  # each FP32 kernel choice is logged once per process

#: Autocast dtypes a `TorchRunner` can run under, by name.
AUTOCAST = {"bf16": "bfloat16", "fp16": "float16"}


class TorchRunner:
    """Runs an eager or TorchScript module under `inference_mode` (optionally under autocast, `AUTOCAST`) on the
    device its parameters live on (CPU for every variant; CUDA when a trained module is scored where it was trained
    or the distill stage's teacher labels reviews on the training GPU)."""

    format: ClassVar[str] = "eager"

    def __init__(self, module: Any, autocast: str | None = None, fp32_linear: str | None = None) -> None:
        """`fp32_linear`: None runs `module` as given; else the kernel of its FP32 `Linear` layers on the CPU
        (`pipeline.runtimes.fp32_linear`: `auto`, `onednn` or `torch`), a copy of `module` where oneDNN's."""
        import torch

        if autocast is not None and autocast not in AUTOCAST:
            raise ValueError(f"autocast must be one of {sorted(AUTOCAST)} or None, not {autocast!r}")
        self.module = module
        self.autocast = autocast
        self.dtype = getattr(torch, AUTOCAST[autocast]) if autocast else None
        params = getattr(module, "parameters", None)
        first = next(iter(params()), None) if callable(params) else None
        self.device = first.device if first is not None else torch.device("cpu")
        self.fp32_linear = None if fp32_linear is None else self._linear_kernel(fp32_linear)
        if self.fp32_linear is not None and self.fp32_linear.tag() not in _LOGGED_KERNELS:
            log.info("fp32_linear: %s", self.fp32_linear.tag())
            _LOGGED_KERNELS.add(self.fp32_linear.tag())
        if self.fp32_linear is not None and self.fp32_linear.value == "onednn":
            from pipeline.runtimes.fp32_linear import onednn_linears

            self.module = onednn_linears(module)

    def _linear_kernel(self, asked: str) -> Choice:
        """The kernel of the module's FP32 `Linear` layers: `resolve_fp32_linear` where they run in FP32 on the CPU
        in eager mode; PyTorch's own call on another device, under autocast (oneDNN already runs the CPU's bf16
        products), in a TorchScript graph (its own ops) and where no layer is `replaceable` (bf16 weights,
        fake-quantized or hooked layers)."""
        import torch

        from pipeline.runtimes.fp32_linear import replaceable, resolve_fp32_linear

        if self.device.type != "cpu":
            why = f"runs on {self.device}"
        elif self.autocast is not None:
            why = f"runs under {self.autocast} autocast"
        elif isinstance(self.module, torch.jit.ScriptModule):
            why = "a TorchScript graph runs its own ops"
        elif isinstance(self.module, torch.nn.Module) and not any(map(replaceable, self.module.modules())):
            why = "no plain FP32 Linear layer to replace"
        else:
            return resolve_fp32_linear(asked)
        return Choice("fp32_linear", asked, "torch", why)

    @classmethod
    def load(cls, directory: Path, info: VariantInfo | None, threads: int | None = None,
             **options: Any) -> TorchRunner:
        """The finetuned HF model in `directory`; options `cls_readout` (the [CLS]-only last layer,
        `pipeline.runtimes.readout`; raises `ReadoutError` for a head that reads more), `autocast` (`AUTOCAST`
        or None) and `fp32_linear` (the kernel of its FP32 `Linear` layers: `auto`, the default, `onednn` or
        `torch`); any other option is a `VariantError`."""
        options = checked_options("torch", options, {"cls_readout": (False, True), "autocast": (None, *AUTOCAST),
                                                     "fp32_linear": ("auto", *FP32_LINEAR)})
        from pipeline.modeling import load_finetuned

        model, _, _ = load_finetuned(directory)
        if options.get("cls_readout"):
            from pipeline.runtimes.readout import cls_readout

            model = cls_readout(model)
        set_torch_threads(threads)
        return cls(logits_module(model), autocast=options.get("autocast"),
                   fp32_linear=options.get("fp32_linear", "auto"))

    def describe(self) -> dict[str, Any]:
        import torch

        linear = {} if self.fp32_linear is None else {"fp32_linear": self.fp32_linear.value,
                                                        "fp32_linear_reason": self.fp32_linear.reason}
        return {"runtime": "torch", "threads": torch.get_num_threads(), "device": str(self.device),
                "autocast": self.autocast or "none", **linear}

    def __call__(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        import torch

        ids = torch.from_numpy(np.ascontiguousarray(input_ids, dtype=np.int64)).to(self.device)
        mask = torch.from_numpy(np.ascontiguousarray(attention_mask, dtype=np.int64)).to(self.device)
        with torch.inference_mode(), torch.autocast(self.device.type, dtype=self.dtype,
                                                     enabled=self.dtype is not None):
            out = self.module(ids, mask)
        logits = out[0] if isinstance(out, tuple | list) else getattr(out, "logits", out)
        return logits.float().cpu().numpy()


@functools.cache
def _logits_module_class() -> type:
    """The `torch.nn.Module` class behind `logits_module` (built on first use: importing this module does not
    import torch)."""
    import torch

    class LogitsModule(torch.nn.Module):
        """`(input_ids, attention_mask) -> logits`: the positional signature every exported variant shares."""

        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    return LogitsModule


def logits_module(model: Any) -> Any:
    """A Hugging Face classifier as a module called positionally, `(input_ids, attention_mask) -> logits`, like the
    traced and exported graphs: what TorchScript traces, torch.export exports (ONNX, OpenVINO) and `TorchRunner`
    runs eagerly. The one copy of that wrapper."""
    return _logits_module_class()(model)


def predict_logits_on(model: Any, device: str, seqs: Sequence[np.ndarray], batch_size: int, pad_id: int,
                      autocast: str | None = None, progress: str | None = None) -> np.ndarray:
    """`predict_logits` of a HF model moved to `device` (under `autocast`, with the `auto` kernel for its FP32
    `Linear` layers: see `TorchRunner`); the model is back on the CPU afterwards, also when scoring fails, where the
    stages save, copy and export it (oneDNN's layers, where chosen, are on a copy)."""
    model.to(device)
    try:
        runner = TorchRunner(logits_module(model), autocast=autocast, fp32_linear="auto")
        return predict_logits(runner, seqs, batch_size, pad_id, progress)
    finally:
        model.to("cpu")
