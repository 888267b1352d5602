"""The `package` stage: pick the variant to serve and build `model_store/sentiment.mar` with it.

The archive holds the variant directory (`model/`), the TorchServe-independent code it needs
(`pipeline/`, `serving/protocol.py`), `serving.json` (limits, threads, the model label answered in every
response) and the handler. Nothing is installed per model at serve time."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.core.io import write_json
from pipeline.core.params import PackageParams, Params, TargetsParams
from pipeline.variants.registry import REFERENCE, VARIANTS

log = logging.getLogger(__name__)


ROOT = Path(__file__).resolve().parents[2]


ARCHIVE_VERSION = "1.0"  # TorchServe's own version key; the registry version travels in serving.json


class PackageError(RuntimeError):
    """The archive could not be built."""


@dataclass(frozen=True)
class Choice:
    """The variant to serve and why."""

    name: str
    reason: str


def choose_variant(variants: dict[str, dict[str, Any]], params: PackageParams, targets: TargetsParams) -> Choice:
    """`auto`: the most accurate servable INT8 variant within `targets.max_accuracy_loss_pt` of FP32, else the
    FP32 ONNX export. A variant named in `package.variant` must be servable and built."""
    if params.variant != "auto":
        if params.variant not in {v.name for v in VARIANTS if v.servable}:
            raise PackageError(f"package.variant={params.variant} is not a variant the handler can serve "
                               f"({', '.join(v.name for v in VARIANTS if v.servable)})")
        entry = variants.get(params.variant)
        if entry is None or entry.get("status") != "ok":
            raise PackageError(f"package.variant={params.variant} is not an available variant "
                               f"({sorted(n for n, e in variants.items() if e.get('status') == 'ok')})")
        return Choice(params.variant, "named in params (package.variant)")
    ref = variants[REFERENCE]["accuracy"]
    budget = targets.max_accuracy_loss_pt
    int8 = {v.name for v in VARIANTS if v.cpu_int8}
    ok = {n: e for n, e in variants.items()
          if n in int8 and e.get("status") == "ok" and 100 * (ref - e["accuracy"]) <= budget}
    if ok:
        best = max(ok, key=lambda n: (ok[n]["accuracy"], -ok[n]["size_mb"]))
        return Choice(best, f"most accurate INT8 variant within {budget} pt of FP32 "
                            f"({100 * ok[best]['accuracy']:.2f}% vs {100 * ref:.2f}%)")
    return Choice("fp32-onnx", f"no INT8 variant within {budget} pt of FP32; serving FP32 ONNX")


def registry_label(finetuned: Path) -> dict[str, Any]:
    """Registered model name/version of the finetuned model (written by the finetune stage), if any."""
    path = finetuned / "registered.json"
    return json.loads(path.read_text()) if path.is_file() else {"name": "unregistered", "version": "0"}


def build_archive(variant_dir: Path, choice: Choice, registry: dict[str, Any], params: PackageParams,
                  mar_path: Path) -> dict[str, Any]:
    """Stage the archive contents and run `torch-model-archiver`; returns the serving config written."""
    model_label = f"{registry['name']}:v{registry['version']}/{choice.name}"
    config = {"variant": choice.name, "variant_dir": "model", "model": model_label, "max_texts": params.max_texts,
              "max_body_bytes": params.max_body_bytes, "max_chars_per_text": params.max_chars_per_text,
              "max_json_depth": params.max_json_depth, "threads": params.threads, "choice_reason": choice.reason,
              "registered_model": registry}
    mar_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mar-") as tmp:
        staging = Path(tmp) / "extra"
        shutil.copytree(variant_dir, staging / "model")
        shutil.copytree(ROOT / "pipeline", staging / "pipeline", ignore=shutil.ignore_patterns("__pycache__"))
        (staging / "serving").mkdir()
        for f in ("__init__.py", "protocol.py"):
            shutil.copy2(ROOT / "serving" / f, staging / "serving" / f)
        write_json(staging / "serving.json", config)
        cmd = [str(Path(sys.executable).with_name("torch-model-archiver")), "--model-name", mar_path.stem,
               "--version", ARCHIVE_VERSION, "--handler", str(ROOT / "serving" / "handler.py"),
               "--extra-files", str(staging), "--export-path", str(Path(tmp)), "--archive-format", "default",
               "--force"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise PackageError(f"torch-model-archiver failed: {proc.stderr[-2000:]}")
        shutil.move(str(Path(tmp) / f"{mar_path.stem}.mar"), mar_path)
    log.info("built %s serving %s (%s)", mar_path, model_label, choice.reason)
    return config


def run_package_stage(finetuned: Path, variants_root: Path, variants_metrics: Path, mar: Path, manifest_path: Path,
                      params: Params) -> dict[str, Any]:
    """Choose the variant to serve, build the `.mar` and record what it serves (manifest and MLflow)."""
    from pipeline.core.io import read_json
    from pipeline.core.params import to_dict
    from pipeline.core.tracking import stage_run
    from pipeline.variants.registry import directories

    choice = choose_variant(read_json(variants_metrics), params.package, params.targets)
    registry = registry_label(finetuned)
    with stage_run(params.mlflow, "package") as run:
        run.log_sections({"package": to_dict(params.package), "targets": to_dict(params.targets)})
        config = build_archive(directories(variants_root)[choice.name], choice, registry, params.package, mar)
        manifest = {**config, "mar": str(mar), "mar_size_mb": round(mar.stat().st_size / 1e6, 3)}
        write_json(manifest_path, manifest)
        run.set_tags({"served_variant": choice.name, "served_model": config["model"],
                      "choice_reason": choice.reason, "registered_model_name": registry["name"],
                      "registered_model_version": registry["version"],
                      "registered_model_link": f"models:/{registry['name']}/{registry['version']}"})
        run.log_metrics({"mar_size_mb": manifest["mar_size_mb"]})
        run.log_artifact(manifest_path)
    return manifest
