"""The `finetune` stage with its MLflow bookkeeping (rank 0 only under DDP)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from pipeline.config import DataParams, MlflowParams, ModelParams, TrainParams, to_dict
from pipeline.train import FinetuneResult, finetune

log = logging.getLogger(__name__)


def is_rank_zero() -> bool:
    """True in the launching process; DDP re-launches the stage with LOCAL_RANK/NODE_RANK set."""
    return int(os.environ.get("LOCAL_RANK", 0)) == 0 and int(os.environ.get("NODE_RANK", 0)) == 0


def run_finetune(tokenized_dir: Path, model_dir: Path, metrics_path: Path, plots_dir: Path, report_dir: Path,
                 data: DataParams, model: ModelParams, train: TrainParams, tracking: MlflowParams,
                 predictions_path: Path | None = None) -> FinetuneResult:
    """Finetune inside an MLflow child run; log curves, metrics, the model, and register it."""
    import mlflow

    from pipeline.tracking import log_params_flat, stage_run

    if not is_rank_zero():
        return finetune(tokenized_dir, model_dir, metrics_path, plots_dir, report_dir, data, model, train,
                        predictions_path=predictions_path)

    with stage_run(tracking, "finetune") as run:
        from lightning.pytorch.loggers import MLFlowLogger

        log_params_flat({"data": to_dict(data), "model": to_dict(model), "train": to_dict(train)})
        logger = MLFlowLogger(tracking_uri=tracking.tracking_uri, run_id=run.info.run_id)
        result = finetune(tokenized_dir, model_dir, metrics_path, plots_dir, report_dir, data, model, train,
                          mlflow_logger=logger, predictions_path=predictions_path)
        mlflow.log_metrics(result.metrics)
        mlflow.log_artifact(str(metrics_path))
        mlflow.log_artifacts(str(plots_dir), "curves")
        mlflow.log_artifacts(str(report_dir), "reports")
        mlflow.log_artifacts(str(model_dir), "model")
        if predictions_path is not None and predictions_path.exists():
            mlflow.log_artifact(str(predictions_path), "predictions")  # the logits evaluate's FP32 row reuses
        version = register(tracking, run.info.run_id, result)
        write_registration(model_dir, tracking.registered_model_name, version, run.info.run_id)
    return result


def register(tracking: MlflowParams, run_id: str, result: FinetuneResult) -> str:
    """Register the run's `model` artifact directory (HF format) as a new version in the model registry."""
    import mlflow
    from mlflow.exceptions import MlflowException

    client = mlflow.MlflowClient()
    name = tracking.registered_model_name
    try:
        client.create_registered_model(name, description="IMDB sentiment classifier finetuned by this pipeline")
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    scores = {k: f"{result.metrics[k]:.4f}" for k in ("test_accuracy", "test_f1") if k in result.metrics}
    version = client.create_model_version(name, source=mlflow.get_artifact_uri("model"), run_id=run_id,
                                          tags=scores)
    mlflow.set_tag("registered_model_version", version.version)
    log.info("registered model %s version %s", name, version.version)
    return str(version.version)


def write_registration(model_dir: Path, name: str, version: str, run_id: str) -> None:
    """Record the registry entry next to the model so later stages (package) can point back to it."""
    from pipeline.io import write_json

    write_json(model_dir / "registered.json", {"name": name, "version": version, "run_id": run_id})
