"""The serving matrix: every servable variant a run built, on both real servers, under `benchmarks.serve_load`'s
sweep (closed-loop clients on kept-open connections, malformed requests mixed in, the same archive's model called
in-process as the reference), so a change to what is served or to how a runtime is called is measured on all of
them, not only on the variant the package stage chose.

    python -m benchmarks.serve_matrix --concurrency 1,8,32 --duration 10 --malformed-share 0.1

For each variant of `metrics/variants.json` that was built and that the handler can run (`VariantSpec.servable`),
in the catalog's order: its `.mar` is built as the package stage builds one (`build_archive`, the params' limits)
and served by TorchServe as `make serve` starts it (`serving/config.properties`, free loopback ports), then its
MLflow model (the evaluate stage's LoggedModel, `--model-uri models:/<id>`) by `python -m serving.mlflow_server`;
each server is started for its variant and stopped before the next. A variant whose MLflow model holds no files
in this store is measured on TorchServe only, with the reason recorded; a cell that fails (its archive, a server
that does not start or answer) is recorded as failed and the others are still measured. After each variant the
cells so far are in `<out>.partial.json`; `--out` keeps the previous whole result until the sweep ends. Prints one
table and writes
`benchmarks/results/serve_matrix.json` (each row's full `serve_load` record, the CPU and its ISA flags) and a chart
of served / in-process per variant, server and concurrency beside it.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.serve_load import main as serve_load_main
from pipeline.core.io import read_json, write_json

ROOT = Path(__file__).resolve().parents[1]
SERVERS = ("torchserve", "mlflow")


def servable(variants: dict[str, dict[str, Any]], dirs: dict[str, Path], wanted: list[str] | None) -> list[str]:
    """The variants to serve, in the catalog's order: built (status ok, directory present) and servable; `wanted`
    narrows them and names no variant that is not."""
    from pipeline.runtimes.catalog import VARIANTS

    ready = [s.name for s in VARIANTS if s.servable and variants.get(s.name, {}).get("status") == "ok"
             and s.name in dirs and dirs[s.name].is_dir()]
    if wanted is None:
        return ready
    unknown = [w for w in wanted if w not in ready]
    if unknown:
        raise SystemExit(f"not servable in this run: {', '.join(unknown)} (servable: {', '.join(ready)})")
    return [name for name in ready if name in wanted]


def sweep_args(args: argparse.Namespace) -> list[str]:
    """The `serve_load` options every row shares."""
    return ["--concurrency", ",".join(map(str, args.concurrency)), "--duration", str(args.duration),
            "--warmup", str(args.warmup), "--malformed-share", str(args.malformed_share),
            "--imdb-dir", str(args.imdb_dir), "--ready-timeout", str(args.ready_timeout)]


def archived(name: str, variant_dir: Path, work: Path, args: argparse.Namespace) -> Path:
    """`name` archived as the package stage archives the served variant (the params' limits), in `work`'s model
    store: what TorchServe serves and what both servers' in-process reference loads."""
    from pipeline.deployment.archive import build_archive
    from pipeline.selection import ServedChoice

    mar = work / "model_store" / "sentiment.mar"
    build_archive(variant_dir, ServedChoice(name, "benchmarks.serve_matrix: every servable variant"),
                  {"name": "serve-matrix", "version": "0"}, args.settings.package, mar)
    return mar


def on_torchserve(mar: Path, variant_dir: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Serve the archive `mar` (in `work`'s model store) on TorchServe with `--ts-config` and sweep it."""
    from serving.local_servers import running_torchserve

    out = work / "torchserve.json"
    with running_torchserve(work, variant_dir, config=args.ts_config, timeout=args.ready_timeout) as server:
        serve_load_main(["--server", "torchserve", "--url", server.url, "--key-file", str(work / "key_file.json"),
                         "--ts-config", str(work / "config.properties"), "--mar", str(mar), *sweep_args(args),
                         "--out", str(out)])
    return read_json(out)


def absolute_store(uri: str) -> str:
    """`uri` with a relative SQLite path made absolute: against the caller's directory where
    $MLFLOW_TRACKING_URI names it, else against the checkout's root, where `make run` wrote the params' store. The
    server and this process then read the same file."""
    prefix = "sqlite:///"
    if not uri.startswith(prefix) or uri.startswith(prefix + "/"):
        return uri
    base = Path.cwd() if os.environ.get("MLFLOW_TRACKING_URI") else ROOT
    return prefix + str((base / uri[len(prefix):]).resolve())


def on_mlflow(model_id: str | None, mar: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Serve the variant's MLflow model by `serving.mlflow_server` and sweep it (in-process: the same archive's
    model); a record saying why not where the store holds no files for it."""
    from pipeline.core.model_registry import model_with_files
    from serving.local_servers import free_port, start_server, stop_server

    if not model_id or not model_with_files(model_id, tracking_uri=args.store):
        return {"skipped": f"MLflow model {model_id or '(none recorded)'} holds no files in {args.store}"}
    work.mkdir(parents=True, exist_ok=True)
    port, out = free_port(), work / "mlflow.json"
    cmd = [sys.executable, "-m", "serving.mlflow_server", "--host", "127.0.0.1", "--port", str(port),
           "--params", str(args.params), "--model-uri", f"models:/{model_id}", "--log-dir", str(work / "logs")]
    proc = start_server(cmd, {**os.environ, "MLFLOW_TRACKING_URI": args.store}, ROOT, f"http://127.0.0.1:{port}/ready",
                        work / "mlflow.log",
                        timeout=args.ready_timeout)
    try:
        serve_load_main(["--server", "mlflow", "--url", f"http://127.0.0.1:{port}", "--mar", str(mar),
                         "--ts-config", str(args.ts_config), *sweep_args(args), "--out", str(out)])
    finally:
        stop_server(proc)
    return read_json(out)


def failed_or(sweep: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """`sweep()`'s record, or, where it failed (an archive not built, a server that did not start or stopped
    answering, a store that could not be read), a record saying so: the other cells are still measured."""
    try:
        return sweep()
    # any failure of one cell is that cell's finding; serve_load exits (SystemExit) when no first review is answered
    except (Exception, SystemExit) as exc:
        print(f"  failed: {type(exc).__name__}: {str(exc)[:2000]}", flush=True)
        return {"failed": f"{type(exc).__name__}: {str(exc)[:2000]}"}


def summary(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Per concurrency level: what the table and the chart show of one `serve_load` record."""
    keys = ("concurrency", "p50_ms", "valid_requests_per_s", "in_process_per_s", "served_vs_in_process",
            "valid_errors", "malformed_4xx_pct")
    return [{k: row.get(k) for k in keys} for row in record.get("rows", [])]


def table(matrix: dict[str, dict[str, Any]]) -> str:
    """One Markdown row per variant and server: p50, valid req/s and served / in-process at each level."""

    def cells(rows: list[dict[str, Any]], key: str, spec: str) -> str:
        return " / ".join("n/a" if r[key] is None else format(r[key], spec) for r in rows)

    lines = ["| variant | server | p50 ms | valid req/s | served / in-process | errors on valid | malformed 4xx % |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for name, servers in matrix.items():
        for server, record in servers.items():
            if "skipped" in record or "failed" in record:
                why = f"skipped: {record['skipped']}" if "skipped" in record else f"failed: {record['failed'][:120]}"
                lines.append(f"| {name} | {server} | {why} | | | | |")
                continue
            rows = summary(record)
            lines.append(f"| {name} | {server} | {cells(rows, 'p50_ms', '.1f')} "
                         f"| {cells(rows, 'valid_requests_per_s', '.1f')} "
                         f"| {cells(rows, 'served_vs_in_process', '.2f')} "
                         f"| {sum(r['valid_errors'] or 0 for r in rows)} "
                         f"| {cells(rows, 'malformed_4xx_pct', '.0f')} |")
    return "\n".join(lines)


def chart(matrix: dict[str, dict[str, Any]], path: Path, target: float) -> None:
    """Served / in-process per variant, one panel per server, one bar per concurrency level, the target as a line."""
    import matplotlib.pyplot as plt
    import numpy as np

    names = list(matrix)
    servers = [s for s in SERVERS if any(s in m for m in matrix.values())]
    levels = sorted({r["concurrency"] for s in matrix.values() for rec in s.values() for r in summary(rec)})
    fig, axes = plt.subplots(1, len(servers), figsize=(6 * len(servers), 4), sharey=True, squeeze=False)
    width = 0.8 / max(len(levels), 1)
    for ax, server in zip(axes[0], servers, strict=True):
        for k, level in enumerate(levels):
            ratios = [next((r["served_vs_in_process"] for r in summary(matrix[n].get(server, {}))
                            if r["concurrency"] == level), None) for n in names]
            ax.bar(np.arange(len(names)) + k * width, [np.nan if v is None else v for v in ratios], width,
                   label=f"{level} client{'s' if level > 1 else ''}")
        ax.axhline(target, color="black", linestyle="--", linewidth=1, label=f"target {target}")
        ax.set_title(server)
        ax.set_xticks(np.arange(len(names)) + width * (len(levels) - 1) / 2, names, rotation=30, ha="right")
    axes[0][0].set_ylabel("served / in-process (valid req/s)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def arguments(argv: list[str] | None) -> argparse.Namespace:
    """The command's options, checked before any server starts; paths made absolute (the servers run in the
    checkout's root, whatever the caller's directory)."""
    from benchmarks.serve_load import _concurrencies

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=Path, default=ROOT / "params.yaml")
    parser.add_argument("--variants-metrics", type=Path, default=ROOT / "metrics/variants.json")
    parser.add_argument("--variants-dir", type=Path, default=ROOT / "models/variants")
    parser.add_argument("--variants", type=lambda v: [s for s in v.split(",") if s],
                        help="comma-separated; default: every servable variant the run built")
    parser.add_argument("--imdb-dir", type=Path,
                        default=Path(os.environ.get("IMDB_DIR", ROOT.parent / "shared/data/imdb")))
    parser.add_argument("--concurrency", type=_concurrencies, default=[1, 8, 32], help="serve_load's sweep: 1,8,32")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per level, served and in-process")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds of uncounted requests before each level")
    parser.add_argument("--malformed-share", type=float, default=0.1)
    parser.add_argument("--servers", type=lambda v: [s for s in v.split(",") if s], default=list(SERVERS),
                        help="comma-separated: torchserve, mlflow (default both)")
    parser.add_argument("--ts-config", type=Path, default=ROOT / "serving/config.properties",
                        help="the TorchServe configuration to start it with (its listeners and model store are "
                             "rewritten) and whose batchSize both servers' in-process reference uses")
    parser.add_argument("--ready-timeout", type=float, default=180.0,
                        help="seconds a server may take to start and answer its first review")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/serve_matrix.json")
    args = parser.parse_args(argv)
    if not args.servers or set(args.servers) - set(SERVERS):
        parser.error(f"--servers takes {', '.join(SERVERS)}")
    if args.variants == []:
        parser.error("--variants names no variant")
    for name in ("params", "variants_metrics", "variants_dir", "imdb_dir", "ts_config", "out"):
        setattr(args, name, getattr(args, name).resolve())
    from pipeline.core.params import load_params
    from pipeline.core.parent_run import tracking_uri

    args.settings = load_params(args.params)  # read once: the archives' limits and the MLflow store
    args.store = absolute_store(tracking_uri(args.settings.mlflow))
    return args


def main(argv: list[str] | None = None) -> None:
    """Sweep every servable variant on both servers; print the table, write the JSON and the chart."""
    from benchmarks.provenance import provenance
    from benchmarks.serve_load import RATIO_TARGETS
    from pipeline.runtimes.catalog import directories

    args = arguments(argv)
    variants = read_json(args.variants_metrics)
    dirs = directories(args.variants_dir)
    if not (names := servable(variants, dirs, args.variants)):
        raise SystemExit(f"{args.variants_metrics} records no servable variant built under {args.variants_dir}")
    result = {**provenance("benchmarks.serve_matrix", argv), "variants": names,
              "targets_served_vs_in_process": RATIO_TARGETS, "matrix": {}}
    partial_out = args.out.with_suffix(".partial.json")
    for i, name in enumerate(names, 1):
        print(f"[{i}/{len(names)}] {name}", flush=True)
        result["matrix"][name] = variant_cells(name, dirs[name], variants[name].get("model_id"), args)
        write_json(partial_out, result)  # the cells so far; the previous full result stays in --out
    write_json(args.out, result)
    partial_out.unlink(missing_ok=True)
    chart(result["matrix"], args.out.with_suffix(".png"), min(RATIO_TARGETS.values()))
    print(table(result["matrix"]))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


def variant_cells(name: str, variant_dir: Path, model_id: str | None, args: argparse.Namespace) -> dict[str, Any]:
    """One variant on each server asked for: its archive built once, then a record per server (a failed one says
    why, the others are still measured)."""
    with tempfile.TemporaryDirectory(prefix=f"serve-matrix-{name}-") as tmp:
        work = Path(tmp) / "torchserve"
        built = failed_or(lambda: {"mar": archived(name, variant_dir, work, args)})
        if "failed" in built:
            return {server: built for server in SERVERS if server in args.servers}
        mar = built["mar"]
        sweeps = {"torchserve": partial(on_torchserve, mar, variant_dir, work, args),
                  "mlflow": partial(on_mlflow, model_id, mar, Path(tmp) / "mlflow", args)}
        return {server: failed_or(sweeps[server]) for server in SERVERS if server in args.servers}


if __name__ == "__main__":
    main()
