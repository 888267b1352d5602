"""The kernel that runs PyTorch's FP32 `Linear` layers on the CPU for inference: PyTorch's own BLAS call (MKL's
sgemm in the x86 wheels) or oneDNN's, decided at run time from the CPU (`resolve_fp32_linear`) and recorded by
every runner that uses it.

Why there is a choice: MKL picks its kernels by CPU vendor, and on an AMD CPU with AVX512 its sgemm runs code
paths well short of the CPU's width, while the oneDNN that the same wheel bundles picks by instruction set alone
(docs/weight-formats.md#fp32-gemm-kernels-on-an-avx512-amd-cpu has the measurements). `onednn_linears` gives a
copy of a module whose plain `nn.Linear` layers multiply with oneDNN's prepacked-weight inner product
(`torch.ops.mkldnn._linear_pointwise`, the op PyTorch's inductor also uses for CPU linears): the same product up to
float rounding. Both ops are private to PyTorch, so `onednn_linear_works` checks that they exist and agree with
`torch.nn.functional.linear` before any runner uses them; where they do not, PyTorch's own call stays and the
reason says so. Only the plain FP32 model is for this: a runner asks for it (`TorchRunner(fp32_linear=...)`) where it
runs the finetuned reference; the fake-quantized QAT models, whose quantizers wrap or hook their layers, are run as
they are given. As a guard, subclasses of `nn.Linear`, layers with hooks and non-FP32 weights are never replaced."""

from __future__ import annotations

import copy
import functools
from typing import Any

from pipeline.core.machine import Choice, cpu_vendor, decision_flags

#: What `resolve_fp32_linear` may resolve to, and what a runner may be asked for explicitly.
FP32_LINEAR = ("onednn", "torch")
#: The CPU vendor whose AVX512 kernels MKL dispatches to (as /proc/cpuinfo's `vendor_id` names it).
MKL_FULL_WIDTH_VENDOR = "GenuineIntel"
#: Largest |difference| from `F.linear` that `onednn_linear_works` accepts on its probe product (float rounding).
PROBE_TOLERANCE = 1e-4


@functools.cache
def onednn_linear_works() -> str:
    """Empty where oneDNN's prepacked linear runs in this PyTorch and matches `F.linear` on a probe product, else
    why it cannot be used (checked once per process)."""
    import torch

    if not torch.backends.mkldnn.is_available():
        return "this PyTorch build has no oneDNN"
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return "this PyTorch has no mkldnn._linear_pointwise / _reorder_linear_weight"
    with torch.random.fork_rng(devices=[]):  # the layer's initialisation leaves the seeded global stream alone
        layer = torch.nn.Linear(64, 48)
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(0))
    try:
        with torch.inference_mode():
            got = onednn_linear(layer)(x)
            want = torch.nn.functional.linear(x, layer.weight, layer.bias)
    except RuntimeError as exc:
        return f"oneDNN's linear failed on a probe product: {exc}"
    diff = float((got - want).abs().max())
    if diff > PROBE_TOLERANCE:
        return f"oneDNN's linear differs from F.linear by {diff:.2e} on a probe product"
    return ""


def resolve_fp32_linear(asked: str = "auto", flags: frozenset[str] | None = None,
                        vendor: str | None = None) -> Choice:
    """The kernel for FP32 `Linear` layers on this CPU. `auto`: oneDNN on a CPU with AVX512F that is not Intel's
    (where MKL does not run its AVX512 sgemm) when this PyTorch's oneDNN linear works and its BLAS is MKL; PyTorch's
    own call elsewhere (on Intel CPUs MKL's own kernels; AVX2-only CPUs are not measured, so nothing changes there).
    `onednn` / `torch` are taken as asked (`onednn` still needs a working oneDNN linear)."""
    import torch

    if asked not in ("auto", *FP32_LINEAR):
        raise ValueError(f"fp32_linear must be one of auto, {', '.join(FP32_LINEAR)}, not {asked!r}")
    if asked != "auto":
        broken = onednn_linear_works() if asked == "onednn" else ""
        if broken:
            raise RuntimeError(f"fp32_linear: onednn was asked for, but {broken}")
        return Choice("fp32_linear", asked, asked, "set explicitly")
    flags, note = (flags, "") if flags is not None else decision_flags()
    vendor = cpu_vendor() if vendor is None else vendor
    if vendor == MKL_FULL_WIDTH_VENDOR:
        return Choice("fp32_linear", asked, "torch", f"an Intel CPU: MKL runs its own full-width kernels{note}")
    if "avx512f" not in flags:
        return Choice("fp32_linear", asked, "torch", f"no AVX512F: oneDNN's linear is not measured here{note}")
    if not torch.backends.mkl.is_available():
        return Choice("fp32_linear", asked, "torch", f"this PyTorch's BLAS is not MKL{note}")
    broken = onednn_linear_works()  # probed only where the answer could be oneDNN
    if broken:
        return Choice("fp32_linear", asked, "torch", broken + note)
    return Choice("fp32_linear", asked, "onednn",
                  f"{vendor or 'a non-Intel'} CPU with AVX512F: MKL's sgemm does not run its AVX512 kernels "
                  f"there, oneDNN does{note}")


def fp32_linear_on(device: str) -> str:
    """The kernel an `auto` runner picks for FP32 scoring on `device` ("cpu" or another torch device name): what a
    stage records beside logits it saves, so a later stage reuses them only where it would score the same way."""
    return resolve_fp32_linear("auto").value if device == "cpu" else "torch"


@functools.cache
def _onednn_linear_class() -> type:
    """The class of `onednn_linear`'s layers (built on first use: importing this module does not import torch)."""
    import torch

    class OneDnnLinearModule(torch.nn.Module):
        """An inference-only FP32 `nn.Linear`: its weight prepacked once for oneDNN's inner product."""

        def __init__(self, linear: torch.nn.Linear) -> None:
            super().__init__()
            self.in_features, self.out_features = linear.in_features, linear.out_features
            weight = linear.weight.detach().float()
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
            self.bias = None if linear.bias is None else linear.bias.detach().float().clone()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.dtype != torch.float32:  # the packed weight is FP32: autocast runs keep PyTorch's own call
                raise TypeError(f"the oneDNN linear multiplies float32 inputs only, not {x.dtype}")
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

        def extra_repr(self) -> str:
            return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN prepacked"

    return OneDnnLinearModule


def onednn_linear(linear: Any) -> Any:
    """`linear` (an FP32 `nn.Linear`) as an inference layer on oneDNN's linear, its weight prepacked once."""
    return _onednn_linear_class()(linear)


def replaceable(layer: Any) -> bool:
    """Whether `layer` is one `onednn_linears` replaces: exactly `nn.Linear` (a subclass may add to its forward, as
    fake-quantized layers do), FP32 weights on the CPU, and no hooks (which the replacement would not call)."""
    import torch

    return (type(layer) is torch.nn.Linear and layer.weight.dtype == torch.float32 and layer.weight.device.type == "cpu"
            and not (layer._forward_hooks or layer._forward_pre_hooks))


def onednn_linears(module: Any) -> Any:
    """A copy of `module` (left as it is) in eval mode whose `replaceable` layers run oneDNN's linear; `module`
    itself where it has none (nothing to replace, so nothing is copied)."""
    import torch

    if not any(replaceable(m) for m in module.modules()):
        return module
    copied = copy.deepcopy(module).eval()

    def swap(parent: torch.nn.Module) -> None:
        for name, child in parent.named_children():
            if replaceable(child):
                setattr(parent, name, onednn_linear(child))
            else:
                swap(child)

    swap(copied)
    return copied
