"""The `package` stage: pick the variant to serve and build `model_store/sentiment.mar` with it.

The archive holds the variant directory (`model/`), the TorchServe-independent code the handler imports (those
modules of `pipeline/`, the request contract `pipeline/deployment/protocol.py` included: `archive_code`),
`serving.json` (limits, threads, the model label answered in every response, how the variant is batched and why
(`pipeline.runtimes.batch_invariance`), and the MLflow registry entry it serves: `models:/<name>@<alias>` and the
version) and the handler. Nothing is installed per model at serve time. The same registered version is what
`python -m serving.mlflow_server` (MLflow's scoring server) serves for `models:/<name>@<alias>`."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.core.errors import UserError
from pipeline.core.io import replaced_on_success, write_json
from pipeline.core.params import PackageParams, Params
from pipeline.runtimes.catalog import REFERENCE
from pipeline.selection import ServedChoice, choose_variant

if TYPE_CHECKING:
    from pipeline.core.parent_run import RunContext

log = logging.getLogger(__name__)


ROOT = Path(__file__).resolve().parents[2]


ARCHIVE_VERSION = "1.0"  # TorchServe's own version key; the registry version travels in serving.json


class PackageError(UserError):
    """The archive could not be built."""


def serving_summary(choice: ServedChoice, variants: dict[str, dict[str, Any]], benchmark: dict[str, dict[str, Any]],
                    registry: dict[str, Any]) -> tuple[dict[str, float], dict[str, str]]:
    """The pipeline's headline for its parent run: FP32's test accuracy and the served variant's accuracy, its
    distance from FP32, its batch-1 p50, speed-up over FP32 eager and size (metrics), and what is served where
    (tags). A benchmark row that is missing or skipped leaves its numbers out."""
    served, bench = variants[choice.name], benchmark.get(choice.name, {})
    metrics = {"test_accuracy": variants[REFERENCE]["accuracy"], "served_accuracy": served.get("accuracy"),
               "served_accuracy_delta_pt": served.get("accuracy_delta_pt"), "served_size_mb": served.get("size_mb"),
               "served_p50_ms": bench.get("p50_ms_b1"), "served_speedup": bench.get("speedup_p50_vs_fp32_eager"),
               "fp32_p50_ms": benchmark.get(REFERENCE, {}).get("p50_ms_b1")}
    tags = {"served_variant": choice.name, "served_model_uri": registry["uri"],
            "served_model_version": str(registry["version"]), "served_model_id": registry.get("model_id", ""),
            "choice_reason": choice.reason}
    return {k: float(v) for k, v in metrics.items() if isinstance(v, int | float)}, tags


def archive_code() -> list[Path]:
    """The project files the archive carries beside the handler: every module `serving/handler.py` imports (and
    what those modules read), not the whole `pipeline` package, so the package stage's DVC deps
    (`pipeline.core.stage_deps.COPIES`) are exactly what the archive holds."""
    from pipeline.core.stage_deps import copied_files

    return sorted(f for f in copied_files("package", ROOT) if f.parts[0] == "pipeline")


def build_archive(variant_dir: Path, choice: ServedChoice, registry: dict[str, Any], params: PackageParams,
                  mar_path: Path) -> dict[str, Any]:
    """Stage the archive contents and run `torch-model-archiver`; returns the serving config written."""
    from pipeline.runtimes.record import variant_batching

    model_label = f"{registry['name']}:v{registry['version']}/{choice.name}"
    config = {"variant": choice.name, "variant_dir": "model", "model": model_label, **variant_batching(variant_dir),
              "max_texts": params.max_texts,
              "max_body_bytes": params.max_body_bytes, "max_chars_per_text": params.max_chars_per_text,
              "max_json_depth": params.max_json_depth, "threads": params.threads, "choice_reason": choice.reason,
              "registered_model": registry}
    mar_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mar-") as tmp:
        staging = Path(tmp) / "extra"
        shutil.copytree(variant_dir, staging / "model")
        for rel in archive_code():
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
            copy = shutil.copytree if (ROOT / rel).is_dir() else shutil.copy2
            copy(ROOT / rel, staging / rel)
        write_json(staging / "serving.json", config)
        cmd = [str(Path(sys.executable).with_name("torch-model-archiver")), "--model-name", mar_path.stem,
               "--version", ARCHIVE_VERSION, "--handler", str(ROOT / "serving" / "handler.py"),
               "--extra-files", str(staging), "--export-path", str(Path(tmp)), "--archive-format", "default",
               "--force"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise PackageError(f"torch-model-archiver failed: {proc.stderr[-2000:]}")
        # copied in beside its destination and renamed: a package run killed mid-copy (the temporary folder may
        # be on another file system) leaves the previous archive or none, never a truncated one `make serve` loads
        with replaced_on_success(mar_path) as partial:
            shutil.copyfile(Path(tmp) / f"{mar_path.stem}.mar", partial)
    log.info("built %s serving %s (%s)", mar_path, model_label, choice.reason)
    return config


def run_package_stage(*, variants_root: Path, variants_metrics: Path, benchmark_metrics: Path, mar: Path,
                      manifest_path: Path, params: Params, run_context: RunContext) -> dict[str, Any]:
    """Choose the variant to serve, register its MLflow model as a new version of
    `mlflow.registered_model_name`, build the `.mar` that names that version, then move the alias
    `mlflow.champion_alias` to it and put the pipeline's summary on the execution's parent run (`run_context`).

    The evaluate stage logged every variant as an MLflow model (its id is in `metrics/variants.json`); when that
    model is not in this tracking store or holds no files (logged as external above `evaluate.artifact_max_mb`)
    the variant is logged again here, since the registered, served model must carry its files. Finished
    versions are only added, never deleted; the alias moves only once the archive that serves its version is
    built, and a version whose archive or alias failed is deleted again (`StageRun.registering`)."""
    from pipeline.core.io import read_json
    from pipeline.core.model_registry import alias_version, model_with_files, set_alias
    from pipeline.core.params import to_dict
    from pipeline.core.parent_run import log_parent_summary
    from pipeline.core.run_id import git_commit
    from pipeline.core.tracking import stage_run
    from pipeline.deployment.mlflow_model import log_variant_model
    from pipeline.runtimes.catalog import directories

    variants, benchmark = read_json(variants_metrics), read_json(benchmark_metrics)
    choice = choose_variant(variants, params.package, params.targets, benchmark)
    variant_dir = directories(variants_root)[choice.name]
    entry = variants[choice.name]
    name, alias = params.mlflow.registered_model_name, params.mlflow.champion_alias
    store = run_context.tracking_uri
    with stage_run(run_context, "package") as run:
        run.log_sections({"package": to_dict(params.package), "targets": to_dict(params.targets)})
        model_id = entry.get("model_id")
        if not model_with_files(model_id, tracking_uri=store):
            log.info("%s: logging its MLflow model in the package run (evaluate's model %s is not usable here)",
                     choice.name, model_id)
            model_id = log_variant_model(run, choice.name, variant_dir, params.package,
                                           {"variant": choice.name}).model_id
        previous = alias_version(name, alias, tracking_uri=store)
        with run.registering(name, f"models:/{model_id}", "IMDB sentiment classifier: the variant the pipeline "
                             f"packages and serves (alias @{alias})",
                             {"variant": choice.name, "choice_reason": choice.reason,
                              "pipeline.run_id": run_context.run_id, "git.commit": git_commit()}) as version:
            registry = {"name": name, "version": version, "alias": alias, "uri": f"models:/{name}@{alias}",
                        "version_uri": f"models:/{name}/{version}", "model_id": model_id,
                        "previous_champion_version": previous}
            config = build_archive(variant_dir, choice, registry, params.package, mar)
            set_alias(name, alias, version, tracking_uri=store)
        log.info("%s@%s -> version %s (was %s)", name, alias, version, previous or "unset")
        manifest = {**config, "mar": str(mar), "mar_size_mb": round(mar.stat().st_size / 1e6, 3)}
        write_json(manifest_path, manifest)
        run.set_tags({"served_variant": choice.name, "served_model": config["model"],
                      "choice_reason": choice.reason, "served_batching": config["served_batching"],
                      "served_batching_reason": config["served_batching_reason"], "registered_model_name": name,
                      "registered_model_version": version, "registered_model_alias": alias,
                      "registered_model_link": registry["uri"], "served_model_id": model_id})
        run.log_metrics({"mar_size_mb": manifest["mar_size_mb"]})
        run.log_artifact(manifest_path)
    metrics, tags = serving_summary(choice, variants, benchmark, registry)
    log_parent_summary(run_context, metrics=metrics, tags={**tags, "served_batching": config["served_batching"]})
    return manifest
