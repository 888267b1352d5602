"""How much faster onnxruntime's INT8 matrix products are than FP32 ones on this CPU, at the model's shapes.

The benchmark stage's INT8 target (3x FP32 eager at batch 1, 128 tokens) presumes INT8 kernels much
faster than FP32 ones, as on CPUs with AVX512-VNNI or AMX. This script measures the ceiling directly: one
onnxruntime session per product, each the single node of its graph, at the shapes one all-MiniLM-L6-v2
layer runs at batch 1 and 128 tokens (Q, K, V and output projections 384x384, FFN 384x1536 and 1536x384):

- `fp32`: `MatMul` on float32 activations and weights (what `fp32-onnx` runs);
- `int8`: `DynamicQuantizeMatMul` (com.microsoft): float activations quantized per call to uint8, weights in
  the `quantize.weight_format` the pipeline resolves on this CPU (`--weight-format`, default `auto`: `s8`
  with VNNI/AMX, else `u8`, so the kernel timed is the one the INT8 variants run), int32 accumulation, float
  output: what `int8-dynamic` runs for every weight product;
- `int8-gemm-only`: `MatMulInteger` on activations already in uint8: the bare INT8 kernel.

Per-layer times are summed over the model's layers and compared with the whole-model p50 latencies in
`metrics/benchmark.json` (when present), so the table shows how much of the 3x target the GEMMs alone
could give on this CPU. Prints a table and writes `benchmarks/results/int8_gemm_ceiling.json`.

    python -m benchmarks.int8_gemm_ceiling [--tokens 128 --threads 2 --iterations 300 --weight-format auto]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.provenance import provenance
from pipeline.core.io import read_json, write_json
from pipeline.core.machine import resolve_weight_format
from pipeline.evaluation.latency import percentiles

ROOT = Path(__file__).resolve().parents[1]
# all-MiniLM-L6-v2: hidden 384, FFN 1536, 6 layers; (name, in_features, out_features, count per layer)
LAYER_PRODUCTS = [("qkv+output 384x384", 384, 384, 4), ("ffn-up 384x1536", 384, 1536, 1),
                  ("ffn-down 1536x384", 1536, 384, 1)]
KINDS = ("fp32", "int8", "int8-gemm-only")


def quantized_weight(w: np.ndarray, weight_format: str) -> tuple[np.ndarray, np.float32, np.ndarray]:
    """`w` per tensor as onnxruntime quantizes weights in a `weight_format` (`quantize_data`, symmetric, with the
    pipeline's `weight_options`): int8 +-127 (`s8`), +-64 (`s7`), or uint8 about zero point 128 (`u8`); returns
    (weight, scale, zero point), weight and zero point in the weight's type."""
    from onnxruntime.quantization.quant_utils import quantize_data

    from pipeline.variants.onnx_int8 import weight_options

    options = weight_options(weight_format)
    zero, scale, quantized = quantize_data(w.ravel(), options["weight_type"].tensor_type, True,
                                           reduce_range=options["reduce_range"])
    return quantized.reshape(w.shape), np.float32(scale), np.asarray(zero)


def single_node_model(kind: str, k: int, n: int, weight_format: str = "s8", seed: int = 0) -> bytes:
    """A one-node ONNX graph computing `x @ W` for `x` of shape (tokens, k) in the given arithmetic, INT8
    weights in `weight_format` (resolved: `s8`, `s7` or `u8`)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    w = rng.standard_normal((k, n)).astype(np.float32) * 0.05
    w8, scale, w_zero = quantized_weight(w, weight_format)
    x_type = TensorProto.UINT8 if kind == "int8-gemm-only" else TensorProto.FLOAT
    y_type = TensorProto.INT32 if kind == "int8-gemm-only" else TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("x", x_type, ["tokens", k])]
    outputs = [helper.make_tensor_value_info("y", y_type, ["tokens", n])]
    if kind == "fp32":
        inits = [numpy_helper.from_array(w, "w")]
        node = helper.make_node("MatMul", ["x", "w"], ["y"])
    elif kind == "int8":
        inits = [numpy_helper.from_array(w8, "w"), numpy_helper.from_array(np.array(scale, np.float32), "s"),
                 numpy_helper.from_array(w_zero, "z")]
        node = helper.make_node("DynamicQuantizeMatMul", ["x", "w", "s", "z"], ["y"], domain="com.microsoft")
    elif kind == "int8-gemm-only":
        inits = [numpy_helper.from_array(w8, "w"), numpy_helper.from_array(np.array(128, np.uint8), "xz"),
                 numpy_helper.from_array(w_zero, "z")]
        node = helper.make_node("MatMulInteger", ["x", "w", "xz", "z"], ["y"])
    else:
        raise ValueError(f"unknown kind {kind!r}; use one of {KINDS}")
    graph = helper.make_graph([node], kind, inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    return model.SerializeToString()


def time_product(kind: str, tokens: int, k: int, n: int, threads: int, iterations: int, weight_format: str,
                 warmup: int = 20) -> dict[str, float]:
    """Latency percentiles (ms) of one product in its own onnxruntime session."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    sess = ort.InferenceSession(single_node_model(kind, k, n, weight_format), opts, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    x = (rng.integers(0, 256, (tokens, k)).astype(np.uint8) if kind == "int8-gemm-only"
         else rng.standard_normal((tokens, k)).astype(np.float32))
    for _ in range(warmup):
        sess.run(None, {"x": x})
    samples = []
    for _ in range(iterations):
        t0 = time.perf_counter()
        sess.run(None, {"x": x})
        samples.append((time.perf_counter() - t0) * 1000)
    return percentiles(samples)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--weight-format", default="auto", choices=("auto", "s8", "s7", "u8"),
                        help="INT8 weight format, resolved as quantize.weight_format is (auto: this CPU's choice)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "int8_gemm_ceiling.json")
    args = parser.parse_args(argv)
    weights = resolve_weight_format(args.weight_format)

    rows: list[dict[str, Any]] = []
    for name, k, n, count in LAYER_PRODUCTS:
        # A B C A B C: the three arithmetics alternate so machine drift hits them alike.
        parts: dict[str, list[float]] = {kind: [] for kind in KINDS}
        for _ in range(3):
            for kind in KINDS:
                parts[kind].append(time_product(kind, args.tokens, k, n, args.threads, args.iterations // 3,
                                                         weights.value)["p50"])
        p50 = {kind: float(np.median(v)) for kind, v in parts.items()}
        rows.append({"product": name, "k": k, "n": n, "per_layer": count,
                     **{f"{kind}_p50_ms": p50[kind] for kind in KINDS},
                     "int8_speedup": p50["fp32"] / p50["int8"],
                     "int8_gemm_only_speedup": p50["fp32"] / p50["int8-gemm-only"]})
    model = {kind: args.layers * sum(r[f"{kind}_p50_ms"] * r["per_layer"] for r in rows) for kind in KINDS}
    result: dict[str, Any] = {
        "tokens": args.tokens, "layers": args.layers, "threads": args.threads, "iterations": args.iterations,
        "weight_format": weights.to_dict(),
        "products": rows, "model_weight_products_ms": model,
        "model_weight_products_int8_speedup": model["fp32"] / model["int8"],
        **provenance("benchmarks.int8_gemm_ceiling", argv, threads=args.threads),
    }
    bench = ROOT / "metrics" / "benchmark.json"
    if bench.is_file():
        measured = read_json(bench)
        whole = {name: measured[name]["p50_ms_b1"] for name in ("fp32-eager", "fp32-onnx", "int8-dynamic")
                 if measured.get(name, {}).get("status") == "ok"}
        result["whole_model_p50_ms"] = whole
        if "fp32-eager" in whole:
            eager = whole["fp32-eager"]
            result["target_3x_ms"] = eager / 3
            # Even if everything but the weight products took no time at all:
            result["bound_speedup_weight_products_only"] = eager / model["int8"]
            if "int8-dynamic" in whole:
                result["int8_dynamic_outside_weight_products_ms"] = whole["int8-dynamic"] - model["int8"]
    write_json(args.out, result)

    print(f"\nINT8 vs FP32 matrix products, {args.tokens} tokens, {args.threads} threads (p50 ms per call); "
          f"weights {weights.tag()}")
    print(f"{'product':<22}{'fp32':>9}{'int8':>9}{'int8 gemm':>11}{'int8 x':>9}{'gemm x':>9}")
    for r in rows:
        print(f"{r['product']:<22}{r['fp32_p50_ms']:>9.3f}{r['int8_p50_ms']:>9.3f}{r['int8-gemm-only_p50_ms']:>11.3f}"
              f"{r['int8_speedup']:>9.2f}{r['int8_gemm_only_speedup']:>9.2f}")
    print(f"{'all weight products':<22}{model['fp32']:>9.2f}{model['int8']:>9.2f}{model['int8-gemm-only']:>11.2f}"
          f"{result['model_weight_products_int8_speedup']:>9.2f}")
    if "target_3x_ms" in result:
        print(f"whole model p50 at batch 1 (metrics/benchmark.json): {result['whole_model_p50_ms']}")
        print(f"3x fp32-eager means {result['target_3x_ms']:.2f} ms for the whole model; the INT8 weight products "
              f"alone take {model['int8']:.2f} ms, so even with nothing else the bound is "
              f"{result['bound_speedup_weight_products_only']:.2f}x")
        if "int8_dynamic_outside_weight_products_ms" in result:
            print(f"int8-dynamic spends {result['int8_dynamic_outside_weight_products_ms']:.2f} ms outside its weight "
                  "products (attention scores, softmax, layer norms, GELU, quantizing activations, embeddings)")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
