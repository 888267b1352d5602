# Two commands set everything up on a fresh machine: `make run` (the pipeline) and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
# $(PYTHON) as found on the caller's PATH, before the venv's bin goes first on it (below).
HOST_PYTHON := $(shell command -v $(PYTHON) || echo $(PYTHON))
VENV := .venv
BIN := $(abspath $(VENV))/bin
STAMP := $(VENV)/.installed-$(shell cat requirements.txt pyproject.toml | cksum | cut -d' ' -f1)
SPARK_STAMP := $(VENV)/.spark-installed-$(shell cat requirements-spark.txt | cksum | cut -d' ' -f1)
PIP_STAMP := $(VENV)/.pip-upgraded
# pip processes installing requirements.txt side by side (see the venv rule)
PIP_SHARDS ?= 4
export PATH := $(BIN):$(PATH)
export MPLBACKEND := Agg
export TOKENIZERS_PARALLELISM := false
export HF_HUB_DISABLE_TELEMETRY := 1
export MLFLOW_ENABLE_TELEMETRY := false
export DO_NOT_TRACK := 1
# torchao's fake quantizers (QAT) are plain PyTorch; its prebuilt CUDA/mxfp8 kernels fail to load on a CPU-only
# torch and would say so on every import of transformers.
export TORCHAO_FORCE_SKIP_LOADING_SO_FILES := 1
# The venv's bytecode is written by the first import of each module (see the venv rule). Where the caller's
# environment forbids writing bytecode, every process of a run (a stage, a test worker, a server) would compile torch,
# transformers and MLflow again: the commands here write it, into this checkout's .venv and git-ignored __pycache__.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: run test test-all test-gpu venv venv-spark venv-all lint dvc-deps docs mlflow-ui serve serve-mlflow stop plots score

# The venv with an up-to-date pip; the installs below start from it and run side by side where both are needed
# (`venv-all`): pip spends most of an install on one core, and the sets share no package. The venv is created without
# pip and gets it from $(PYTHON)'s own pip (`--python`, pip 22.3 and later): venv's bundled pip compiles itself on
# install only to be replaced (about 13 s against 3 s); a $(PYTHON) whose pip cannot falls back to ensurepip.
$(PIP_STAMP):
	@test -x $(BIN)/python || $(HOST_PYTHON) -m venv --without-pip $(VENV)
	@$(HOST_PYTHON) -m pip --python $(BIN)/python install --quiet --no-compile --upgrade pip 2> /dev/null \
		|| { $(BIN)/python -m ensurepip --upgrade > /dev/null && $(BIN)/python -m pip install --quiet --upgrade pip; }
	@touch $@

$(STAMP): requirements.txt pyproject.toml | $(PIP_STAMP)
	@# Not compiled at install: of the ~24,000 modules installed, the pipeline and its tests import ~6,000, which the
	@# first import of each compiles into the venv (PYTHONDONTWRITEBYTECODE is lifted below); compiling them all ahead
	@# (pip's default, or compileall on every core) cost a fresh machine a minute more than that.
	@# requirements.txt pins every package the install needs (setuptools and wheel too), so it installs without a
	@# resolver (--no-deps) in PIP_SHARDS pip processes side by side, every PIP_SHARDS-th line each: a pip waits
	@# more than it computes (creating the ~24,000 files, reading the index), so more processes than cores overlap
	@# those waits (docs/testing.md). `pip check` then proves the set whole and consistent.
	@rm -f $(VENV)/lock-*.txt
	@for k in $$(seq 0 $$(($(PIP_SHARDS) - 1))); do \
		awk -v n=$(PIP_SHARDS) -v k=$$k 'NR % n == k' requirements.txt > $(VENV)/lock-$$k.txt; done
	@pids=; for lock in $(VENV)/lock-*.txt; do \
		$(BIN)/python -m pip install --quiet --no-compile --no-deps -r $$lock & pids="$$pids $$!"; done; \
		failed=0; for pid in $$pids; do wait $$pid || failed=1; done; exit $$failed
	$(BIN)/python -m pip check
	@# OpenVINO's model conversion and NNCF send usage events to Google Analytics, from a process forked per event
	@# (about 0.7 s of each conversion, and connections this network refuses). As the variables at the top do for MLflow
	@# and Hugging Face, the commands here send none; OpenVINO's only switch is the consent file that its
	@# `opt_in_out --opt_out` writes in ~/intel. A choice already made there is left as it is.
	@test -e "$$HOME/intel/openvino_telemetry" || $(BIN)/opt_in_out --opt_out >/dev/null || true
	@rm -f $(VENV)/.installed-*
	@touch $@

venv: $(STAMP)

# Apache Spark (requirements-spark.txt) for `make score` and `make test` only: `make run` does not pay for it.
# pyspark and py4j only: nothing of requirements.txt, so it may install while that does.
$(SPARK_STAMP): requirements-spark.txt | $(PIP_STAMP)
	$(BIN)/python -m pip install --quiet --no-compile -r requirements-spark.txt
	@rm -f $(VENV)/.spark-installed-*
	@touch $@

venv-spark: $(SPARK_STAMP)

# Both installs, side by side (for `make test`, `make test-all` and `make score`).
venv-all:
	@$(MAKE) --no-print-directory -j2 venv venv-spark

## run: the whole DVC pipeline on params.yaml (`dvc repro`). PROFILE=name checks profiles/name.yaml, then
## `dvc exp run -S +profiles=name` composes it over params.yaml (DVC's Hydra composition, `.dvc/config`): an
## experiment DVC records, which rewrites params.yaml without comments (`git checkout params.yaml` returns; a later
## PROFILE composes over what is there, and the overrides command names every key that is not the default).
## IMDB_DIR=/path sets data.local_dir; FORCE=1 re-runs every stage, e.g. to time it. Ends with a summary table
## (pipeline/evaluation/run_summary.py: stage times, accuracy, the served variant and its speed-up).
RUN_STARTED := $(shell date +%s)
run: venv
	@test -d .git || git init -q
	$(if $(IMDB_DIR),$(BIN)/python -m pipeline.core.params set data.local_dir=$(IMDB_DIR) &&) \
	export PIPELINE_RUN_ID=$$(date -u +%Y%m%dT%H%M%SZ)-$$(git rev-parse --short HEAD 2>/dev/null || echo nogit) && \
	$(if $(PROFILE),args=$$($(BIN)/python -m pipeline.core.params overrides profiles/$(PROFILE).yaml) && eval "$(BIN)/dvc exp run $(if $(FORCE),--force) $$args",$(BIN)/dvc repro $(if $(FORCE),--force)) && \
	$(BIN)/python -m pipeline.evaluation.run_summary --started $(RUN_STARTED)

## test: unit, data, model and end-to-end tests (CI runs exactly this), in TEST_WORKERS pytest-xdist processes: the
## miniature pipeline run (the longest fixture) goes on while the other tests run beside it; tests/conftest.py
## schedules by module and keeps the modules that share a slow fixture in one worker (MODULE_GROUPS).
## TEST_WORKERS=0 runs them all in this process. Lint (ruff) runs first, so CI, which runs `make test`, lints too.
## The tests marked `slow` are left out: more whole-process runs beside the ones kept (the SIGKILL resume stays;
## SIGTERM and changed-param resumes, the elastic torchrun group, 2-process DDP, the benchmark scripts end to end, the
## torch.compile'd peers and the opt-in prune and distill stages' builds go); `make test-all` runs them too.
TEST_WORKERS ?= 2
test: venv-all
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -n $(TEST_WORKERS) -m "not slow" $(PYTEST_ARGS)

## test-all: `make test` plus the tests marked `slow`.
test-all: venv-all
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -n $(TEST_WORKERS) $(PYTEST_ARGS)

## test-gpu: the tests marked `gpu` (tests/gpu: mixed-precision and compiled training on CUDA, exports from CUDA,
## TensorRT engines); each skips, with its reason, where no CUDA device or no `tensorrt` is present.
## SYSTEM_PYTHON=1 runs them with $(PYTHON) as it is, on a GPU machine whose Python already has CUDA PyTorch.
test-gpu: $(if $(SYSTEM_PYTHON),,venv)
	$(if $(SYSTEM_PYTHON),$(PYTHON),$(BIN)/python) -m pytest -m gpu tests/gpu $(PYTEST_ARGS)

lint: venv
	$(BIN)/ruff check .

## dvc-deps: rewrite each stage's code deps in dvc.yaml from the import graph (pipeline/core/stage_deps.py), after a
## module's imports change; tests/unit/core/test_dvc_graph.py fails until they match (`--check` shows the diff).
dvc-deps: venv
	$(BIN)/python -m pipeline.core.stage_deps --write

## docs: the documentation site (mkdocs.yml: README, RESULTS and docs/) into site/, strictly: a broken link, a missing
## page or a page left out of the nav fails. Open site/index.html, or `.venv/bin/mkdocs serve` for a live preview.
docs: venv
	$(BIN)/mkdocs build --strict --site-dir site

## mlflow-ui: browse runs, the variants' models, metrics and the model registry at http://127.0.0.1:5000
## (the link printed opens MLflow's model-training view; the UI otherwise starts in its GenAI view), on the store the
## stages log to: $$MLFLOW_TRACKING_URI when set, else params' mlflow.tracking_uri. A tracking server is its own UI:
## its address is printed instead.
mlflow-ui: venv
	@store="$${MLFLOW_TRACKING_URI:-$$($(BIN)/python -m pipeline.core.params get mlflow.tracking_uri)}"; \
	case "$$store" in \
	  http://*|https://*) echo "the tracking store is a server; its UI: $$store/#/experiments?workflowType=machine_learning";; \
	  *) echo "open http://127.0.0.1:5000/#/experiments?workflowType=machine_learning ($$store)"; \
	     exec $(BIN)/mlflow ui --backend-store-uri "$$store" --host 127.0.0.1 --port 5000;; \
	esac

plots: venv
	$(BIN)/dvc plots show && echo "open dvc_plots/index.html"

## serve-mlflow: MLflow's scoring server for models:/<mlflow.registered_model_name>@<mlflow.champion_alias>, the variant
## `make run` packaged, behind the request contract TorchServe's handler enforces (serving/mlflow_server.py: limits
## from params' package section, /ready, /metrics, logs/mlflow_server.log rotated), on 127.0.0.1:$(MLFLOW_PORT)
## (POST /invocations); the store is $$MLFLOW_TRACKING_URI when set, else params' mlflow.tracking_uri. Runs in the
## foreground: Ctrl-C stops it.
MLFLOW_PORT ?= 5001
serve-mlflow: venv
	$(BIN)/python -m serving.mlflow_server --host 127.0.0.1 --port $(MLFLOW_PORT) --params params.yaml --log-dir logs

## score: score INPUT (a Parquet or CSV file, or a folder of them; column `text`) with the champion (or
## MODEL_URI=models:/...) on Apache Spark in local mode (MASTER=<a cluster's URL> otherwise) into OUTPUT (Parquet, or CSV
## when it ends in .csv): the id column (ID_COLUMN=name, else an added row_id), label, score, and error for a row the
## request contract refuses (pipeline/deployment/batch_scoring.py; docs/serving.md, "Scoring a file or a table").
MASTER ?= local[*]
score: venv-all
	@test -n "$(INPUT)" -a -n "$(OUTPUT)" || { echo "usage: make score INPUT=reviews.parquet OUTPUT=scored.parquet"; exit 2; }
	$(BIN)/python -m pipeline.deployment.batch_scoring --input "$(INPUT)" --output "$(OUTPUT)" --master "$(MASTER)" \
		$(if $(MODEL_URI),--model-uri "$(MODEL_URI)") $(if $(ID_COLUMN),--id-column "$(ID_COLUMN)") --params params.yaml

## serve: start TorchServe on 127.0.0.1:8080 with model_store/sentiment.mar (`make run` builds it) and return once it
## answers a review (`serving.health --predict`); stop: `make stop`.
## Logs: logs/*.log (serving/log4j2.xml: appended across restarts, rotated at 10 MB); logs/torchserve.out gets warnings
serve: venv
	@test -f model_store/sentiment.mar || { echo "model_store/sentiment.mar missing: run 'make run' first"; exit 1; }
	mkdir -p logs && $(BIN)/torchserve --start --ncs --ts-config serving/config.properties --model-store model_store \
		--log-config serving/log4j2.xml >> logs/torchserve.out 2>&1 < /dev/null
	@# `torchserve --start` returns before the worker has loaded the model and written key_file.json (a call without
	@# the key gets 400): wait until one review is answered, so the next command can call the server.
	@$(BIN)/python -m serving.health --predict --wait 180 || { echo "TorchServe answered no review within 3 minutes:" \
		"see logs/torchserve.out and logs/model_log.log"; exit 1; }
	@echo "inference key: key_file.json; try: $(BIN)/python -m serving.client 'a wonderful film'"

stop: venv
	$(BIN)/torchserve --stop
