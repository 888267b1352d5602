"""The served MLflow model: every variant is logged as a models-from-code pyfunc (`log_predictor_model`) whose
`PythonModel` (`predictor_model_class`) builds a predictor class of `pipeline.deployment` from the variant's
files and answers a DataFrame of texts with `label` and `score`; MLflow's own scoring app for one; and MLflow's own
Spark UDF for one (`pipeline.deployment.batch_scoring`).

Beside `pipeline.core.tracking`, `pipeline.core.parent_run` (runs, metrics) and `pipeline.core.model_registry`,
this is the one other module that imports MLflow (a test checks it): what the served model is belongs to
deployment, how runs are recorded to core."""

from __future__ import annotations

import functools
import importlib
import logging
import shutil
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd  # at module level: MLflow resolves the predictor model's `pd.DataFrame` hints against it

from pipeline.core.parent_run import TAG_LIMIT, client_for, text_values
from pipeline.core.tracking import PARAM_LIMIT, LoggedModelRef, StageRun
from pipeline.deployment.protocol import TEXT_COLUMN, RequestError

if TYPE_CHECKING:
    from pipeline.core.params import PackageParams

log = logging.getLogger(__name__)

#: The columns a served model answers (it reads `pipeline.deployment.protocol.TEXT_COLUMN`, one review per row).
OUTPUT_COLUMNS = ("label", "score")
#: The key under which a logged model's variant directory is stored among its artifacts.
MODEL_ARTIFACT = "variant"
#: The models-from-code entry MLflow runs when it loads a predictor model: it builds the model object from
#: the predictor class named below (imported from the model's own copy of the code, `code_paths`), so
#: nothing is unpickled at load time.
MODEL_CODE = """# MLflow models-from-code entry, written by pipeline.deployment.mlflow_model.log_predictor_model
from pipeline.deployment.mlflow_model import set_predictor_model

set_predictor_model({target!r})
"""


#: What a variant needs at serve time besides the pipeline's own code, by the variant's format: MLflow records
#: these (pinned to the running versions) with each logged model, for `mlflow models serve` with an env manager
#: other than `local`. The tokenizer is read by `tokenizers` alone (`pipeline.data.saved_tokenizer`); transformers
#: is needed by the eager model, and by any variant whose directory has no `tokenizer.json` (`runtime_requirements`).
RUNTIME_PACKAGES: Mapping[str, tuple[str, ...]] = {
    "onnx": ("mlflow", "onnxruntime", "tokenizers", "numpy", "pandas"),
    "openvino": ("mlflow", "openvino", "tokenizers", "numpy", "pandas"),
    "torchscript": ("mlflow", "torch", "tokenizers", "numpy", "pandas"),
    "eager": ("mlflow", "torch", "transformers", "tokenizers", "safetensors", "numpy", "pandas"),
}

#: Reviews stored with every logged model as its input example (and scored once by MLflow when logging).
EXAMPLE_REVIEWS = ("A wonderful, moving film with a superb cast.", "Dull, predictable and far too long.")


def runtime_requirements(fmt: str, directory: Path | None = None) -> list[str]:
    """`RUNTIME_PACKAGES[fmt]` pinned to the versions installed here (`name==version`), with transformers added
    where `directory` has no `tokenizer.json` (its tokenizer then loads through transformers' `AutoTokenizer`)."""
    from importlib.metadata import version

    from pipeline.data.saved_tokenizer import TOKENIZER_FILE

    names = RUNTIME_PACKAGES[fmt]
    if directory is not None and "transformers" not in names and not (Path(directory) / TOKENIZER_FILE).is_file():
        names = (*names, "transformers")
    return [f"{name}=={version(name)}" for name in names]


def model_labels(name: str) -> tuple[dict[str, str], str]:
    """Tags (variant, format, dtype, family from the registry) and the model type MLflow shows for the MLflow
    model of variant `name`."""
    from pipeline.runtimes.catalog import spec

    row = spec(name)
    return {"variant": name, "format": row.format, "dtype": row.precision, "family": row.family}, \
        f"{row.format}-{row.precision}"


def log_variant_model(run: StageRun, name: str, directory: Path, serving: PackageParams,
                      params: Mapping[str, Any]) -> LoggedModelRef:
    """Variant `name` (its `directory`) as an MLflow model of `run`: a pyfunc around
    `pipeline.deployment.inference.ContractPredictor` that checks texts, cuts them and uses threads as the served
    `.mar` does (`serving`), with the packages its format needs at serve time. The request limits stay with the
    servers: the model scores any number of rows."""
    from pipeline.deployment.inference import ContractPredictor

    tags, model_type = model_labels(name)
    return log_predictor_model(run, name, directory, ContractPredictor, examples=EXAMPLE_REVIEWS,
                               model_config={"max_chars": serving.max_chars_per_text, "threads": serving.threads},
                               requirements=runtime_requirements(tags["format"], directory), params=params, tags=tags,
                               model_type=model_type)


def log_predictor_model(run: StageRun, name: str, directory: Path, predictor: type, *, examples: Sequence[str],
                        model_config: Mapping[str, Any], requirements: Sequence[str],
                        params: Mapping[str, Any] | None = None, tags: Mapping[str, Any] | None = None,
                        model_type: str | None = None) -> LoggedModelRef:
    """Log `directory` as an MLflow 3 LoggedModel of `run`: a pyfunc that builds
    `predictor(<its copy of directory>, **model_config)` when loaded and answers a DataFrame of texts
    (column `text`) with `label` and `score`, using `predictor(...).predict(texts)`.

    Logged from code (no pickled objects): the model holds the directory, a copy of the predictor's
    top-level package (`code_paths`, so `mlflow models serve` needs no checkout), a signature, an input
    example and the pinned `requirements` (given, so MLflow need not load the model to guess them)."""
    import mlflow
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, Schema

    signature = ModelSignature(inputs=Schema([ColSpec("string", TEXT_COLUMN)]),
                               outputs=Schema([ColSpec("string", "label"), ColSpec("double", "score")]))
    package = sys.modules[predictor.__module__.split(".")[0]]
    with tempfile.TemporaryDirectory(prefix="pyfunc-") as tmp:
        code = Path(tmp) / "predictor_model.py"
        code.write_text(MODEL_CODE.format(target=f"{predictor.__module__}:{predictor.__qualname__}"))
        package_copy = Path(tmp) / "code" / package.__name__
        shutil.copytree(Path(package.__file__).parent, package_copy,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        info = mlflow.pyfunc.log_model(
            name=name, python_model=str(code), artifacts={MODEL_ARTIFACT: str(directory)},
            code_paths=[str(package_copy)], model_config=dict(model_config), signature=signature,
            input_example=pd.DataFrame({TEXT_COLUMN: list(examples)}), pip_requirements=list(requirements),
            params=text_values(params or {}, PARAM_LIMIT), tags=text_values(tags or {}, TAG_LIMIT),
            model_type=model_type,
        )
    return LoggedModelRef(info.model_id, f"models:/{info.model_id}", files=True)


@functools.cache
def predictor_model_class() -> type:
    """The `mlflow.pyfunc.PythonModel` behind every model `log_predictor_model` logs (built on first use, so
    importing this module does not import MLflow)."""
    from mlflow.pyfunc import PythonModel

    class PredictorModel(PythonModel):
        """Texts in, `label` and `score` out, by the predictor class named `module:Class` in `target`."""

        def __init__(self, target: str) -> None:
            self.target = target
            self.predictor: Any = None

        def load_context(self, context: Any) -> None:
            module, _, attr = self.target.partition(":")
            factory = getattr(importlib.import_module(module), attr)
            config = dict(context.model_config or {})
            if "threads" in config:  # the packaged count, never above the caller's cap (a Spark task's cores)
                from pipeline.core.machine import capped_threads

                config["threads"] = capped_threads(config["threads"])
            self.predictor = factory(context.artifacts[MODEL_ARTIFACT], **config)

        # MLflow infers no signature from `pd.DataFrame` hints, so the logged signature (column `text`) rules and
        # MLflow hands its input over as a DataFrame of that column.
        # The column's values go to the predictor as they are (never `str()`-ed: null would become "None"), so a
        # predictor that checks its input (the request contract's) refuses what is not text.
        def predict(self, context: Any, model_input: pd.DataFrame,
                    params: dict[str, Any] | None = None) -> pd.DataFrame:
            if TEXT_COLUMN not in model_input.columns:
                raise ValueError(f"input needs a column named {TEXT_COLUMN!r}")
            texts = model_input[TEXT_COLUMN].tolist()
            if len(texts) == 1 and isinstance(texts[0], list | tuple | np.ndarray):
                # MLflow reads a dict whose values are lists of strings as one row (a transformers pipeline's list
                # input), so `{"text": [...]}` reaches here as a single row holding the list
                raise RequestError(400, f"{TEXT_COLUMN}[0] must be a string, got a list: MLflow reads a dict of "
                                        f"lists as one row; pass pd.DataFrame({{{TEXT_COLUMN!r}: [...]}}) to score "
                                        "many texts")
            try:
                predictions = self.predictor.predict(texts)
            except RequestError as err:  # the row named by its label too, where the caller's index has labels
                raise RequestError(err.status, labelled(err.message, model_input.index)) from None
            # the caller's index, so the answers join back onto the rows they came from (`df.join(predict(df))`)
            return pd.DataFrame({"label": [p.label for p in predictions],
                                 "score": [float(p.score) for p in predictions]}, columns=list(OUTPUT_COLUMNS),
                                index=model_input.index)

    return PredictorModel


def labelled(message: str, index: pd.Index) -> str:
    """`message` (a row's error, `text[<position>] ...`) naming the row's label as well, where `index` is not the
    default one, so `df.loc[<label>]` finds the row (`text[2]` of a frame indexed `[2, 1, 0]` is the row labelled 0)."""
    position, _, rest = message.partition("]")
    if not position.startswith(f"{TEXT_COLUMN}[") or not position[len(TEXT_COLUMN) + 1:].isdigit():
        return message
    if isinstance(index, pd.RangeIndex) and index.start == 0 and index.step == 1:
        return message
    label = index[int(position[len(TEXT_COLUMN) + 1:])]
    label = label.item() if isinstance(label, np.generic) else label  # 0, not np.int64(0)
    return f"{position}] (the row labelled {label!r}){rest}"


def set_predictor_model(target: str) -> None:
    """Called by the models-from-code entry (`MODEL_CODE`) when MLflow loads or logs a predictor model."""
    import mlflow

    mlflow.models.set_model(predictor_model_class()(target))


@dataclass(frozen=True)
class ServedModel:
    """A pyfunc loaded for serving: MLflow's own scoring app for it, a direct scorer, and the variant it serves."""

    app: Any  # MLflow's FastAPI app (`/invocations`, `/ping`, `/health`, `/version`)
    score: Callable[[list[str]], list[dict[str, Any]]]  # texts -> one `{label, score}` record each (blocking)
    variant: str | None  # its predictor's name; None for a pyfunc this module did not log
    timeout_s: float  # MLflow's scoring-server request timeout (MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT)


def local_model(model_uri: str, *, tracking_uri: str | None) -> str:
    """The files of the model at `model_uri` as a local folder, every lookup made through a client on store
    `tracking_uri`: a `models:/<name>@<alias>`, `models:/<name>/<version>` or `models:/<model id>` URI is resolved
    to where that store keeps the model, then downloaded (a local folder is returned as it is). MLflow's own
    `models:/` resolution would ask the process-wide tracking URI instead, which the server leaves unset. None:
    a URI that needs no store (a path)."""
    from mlflow.artifacts import download_artifacts
    from mlflow.store.artifact.utils.models import get_model_name_and_version, is_models_uri

    location = model_uri
    if is_models_uri(model_uri):
        if tracking_uri is None:
            raise ValueError(f"{model_uri} names a model in a tracking store: give the store (tracking_uri)")
        client = client_for(tracking_uri)
        found = get_model_name_and_version(client, model_uri)
        location = (client.get_logged_model(found[0]).artifact_location if len(found) == 1
                    else client.get_model_version_download_uri(*found))
    return download_artifacts(artifact_uri=location, tracking_uri=tracking_uri)


def warn_if_code_differs(folder: Path, model_uri: str) -> bool:
    """Whether the `pipeline/` copy logged with the model at `folder` differs from the `pipeline` package this
    process runs, logged as a warning when it does. A process that has imported `pipeline` (the server, batch
    scoring in-process) scores with its own copy: MLflow puts the model's `code_paths` on `sys.path`, which does not
    replace a package already imported. So a model logged by another commit (a rollback) answers with this
    checkout's tokenization and runtimes; the `.mar` and `mlflow models serve` run the logged copy."""
    from pipeline.core.io import digest_paths

    logged = folder / "code" / "pipeline"
    if not logged.is_dir():
        return False
    running = Path(__file__).resolve().parents[1]
    if digest_paths([logged]) == digest_paths([running]):
        return False
    log.warning("%s was logged with other pipeline/ code than this process runs (%s): it is scored with this "
                "checkout's code; `make run` logs the model with it, and the .mar or `mlflow models serve` run "
                "the logged copy", model_uri, running)
    return True


def served_model(model_uri: str, *, tracking_uri: str | None) -> ServedModel:
    """The pyfunc at `model_uri` (in store `tracking_uri`: `local_model`), loaded now by MLflow, with MLflow's own
    scoring server for it (the FastAPI app `mlflow models serve` runs under uvicorn) and `score`: texts in, the
    records MLflow's app would put under `predictions` out, without MLflow's JSON parsing and encoding around it.
    (MLflow's app marks its process as a serving one, `MLFLOW_IS_IN_SERVING_ENVIRONMENT`, MLflow's doing.)

    For a model this module logged, `score` calls the predictor its `PythonModel.predict` calls, on the texts as a
    list: the same answers, without the DataFrame in, MLflow's schema check of a string column (the request contract
    has checked every text, and `ContractPredictor` checks them again) and the DataFrame out, which weigh on a
    lone request (measured in docs/serving.md, "Under concurrency"). Any other pyfunc is scored through
    `PyFuncModel.predict` on a DataFrame of one `text` column, as MLflow's app would."""
    import mlflow
    from mlflow.environment_variables import MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT
    from mlflow.exceptions import MlflowException
    from mlflow.pyfunc import scoring_server

    folder = local_model(model_uri, tracking_uri=tracking_uri)
    warn_if_code_differs(Path(folder), model_uri)
    model = mlflow.pyfunc.load_model(folder)
    try:
        python_model = model.unwrap_python_model()
    except MlflowException:  # a pyfunc of another flavour: it has no PythonModel to unwrap
        python_model = None
    # ours only when it is this module's class (the model's copy of the code is this module, already imported)
    predictor = python_model.predictor if isinstance(python_model, predictor_model_class()) else None

    def score(texts: list[str]) -> list[dict[str, Any]]:
        if predictor is not None:
            return [{"label": p.label, "score": float(p.score)} for p in predictor.predict(texts)]
        answer = model.predict(pd.DataFrame({TEXT_COLUMN: texts}))
        if not isinstance(answer, pd.DataFrame):
            answer = pd.DataFrame(answer)
        return answer.to_dict(orient="records")

    return ServedModel(scoring_server.init(model), score, getattr(predictor, "name", None),
                       float(MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT.get()))


class LocalEnvAdvice(logging.Filter):
    """Drops MLflow's warning that `spark_udf(env_manager="local")` does not recreate the model's environment."""

    def filter(self, record: logging.LogRecord) -> bool:
        return 'env_manager="local"' not in record.getMessage()


def spark_model_udf(spark: Any, model_uri: str, env_manager: str = "local") -> Any:
    """MLflow's own Spark UDF (`mlflow.pyfunc.spark_udf`) for the pyfunc at `model_uri`: called on a struct of one
    `text` column, it answers a struct of `label` (string) and `score` (double) per row. MLflow copies the model to
    the executors and each Python worker loads it once, then scores every Arrow batch it is handed with the
    pyfunc's `predict`. `env_manager` "local" runs it in the executors' own Python (the project's venv in local
    mode); "virtualenv", "uv" or "conda" rebuild the model's recorded environment on each executor. MLflow's warning
    that "local" does not rebuild that environment, with its advice to use conda, is left out: "local" is the
    command's documented default (`--env-manager`), and the project's venv is the one the model was logged from."""
    import mlflow

    pyfunc_log = logging.getLogger("mlflow.pyfunc")
    advice = LocalEnvAdvice()
    if env_manager == "local":
        pyfunc_log.addFilter(advice)
    try:
        return mlflow.pyfunc.spark_udf(spark, model_uri, result_type="label string, score double",
                                       env_manager=env_manager)
    finally:
        pyfunc_log.removeFilter(advice)
