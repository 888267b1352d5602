"""Unit: the serving matrix's choice of variants and its table (the sweep itself is serve_load's, on real servers)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.serve_matrix import servable, table


@pytest.fixture
def dirs(tmp_path: Path) -> dict[str, Path]:
    out = {}
    for name in ("fp32-onnx", "int8-static", "int8-openvino", "tensorrt-int8"):
        (tmp_path / name).mkdir()
        out[name] = tmp_path / name
    out["int8-qat"] = tmp_path / "int8-qat"  # recorded but its directory is gone
    return out


VARIANTS = {"fp32-eager": {"status": "ok"}, "fp32-onnx": {"status": "ok"}, "int8-static": {"status": "ok"},
            "int8-openvino": {"status": "ok"}, "int8-qat": {"status": "ok"}, "int8-dynamic": {"status": "skipped"},
            "tensorrt-int8": {"status": "ok"}}


def test_only_built_variants_the_handler_runs_are_served_in_the_catalogs_order(dirs):
    # fp32-eager is not servable (eager), nor is tensorrt (GPU only); int8-dynamic was skipped, int8-qat's directory
    # is missing
    assert servable(VARIANTS, dirs, None) == ["fp32-onnx", "int8-static", "int8-openvino"]
    assert servable(VARIANTS, dirs, ["int8-openvino", "fp32-onnx"]) == ["fp32-onnx", "int8-openvino"]


def test_asking_for_a_variant_that_cannot_be_served_names_it_and_what_can(dirs):
    with pytest.raises(SystemExit, match=r"int8-dynamic.*servable: fp32-onnx, int8-static, int8-openvino"):
        servable(VARIANTS, dirs, ["int8-dynamic"])


def test_the_table_has_a_row_per_variant_and_server_with_each_level_and_the_skip_reason():
    rows = [{"concurrency": c, "p50_ms": 10.0 * c, "valid_requests_per_s": 100.0, "in_process_per_s": 110.0,
             "served_vs_in_process": 100 / 110, "valid_errors": e, "malformed_4xx_pct": 100.0}
            for c, e in ((1, 0), (8, 2))]
    text = table({"int8-static": {"torchserve": {"rows": rows}, "mlflow": {"skipped": "no files"}}})
    lines = text.splitlines()
    assert len(lines) == 4
    assert lines[2] == "| int8-static | torchserve | 10.0 / 80.0 | 100.0 / 100.0 | 0.91 / 0.91 | 2 | 100 / 100 |"
    assert lines[3].startswith("| int8-static | mlflow | skipped: no files")


@pytest.mark.parametrize("servers", ["nginx", "torchserve,triton", ","])
def test_servers_other_than_the_two_are_refused_before_anything_starts(servers, capsys):
    from benchmarks.serve_matrix import main

    with pytest.raises(SystemExit) as exc:
        main(["--servers", servers, "--variants-metrics", "/nonexistent/variants.json"])
    assert exc.value.code == 2 and "--servers takes torchserve, mlflow" in capsys.readouterr().err


def test_the_chart_has_a_panel_per_server_measured(tmp_path):
    from benchmarks.serve_matrix import chart

    rows = [{"concurrency": 1, "served_vs_in_process": 0.7, "valid_errors": 0}]
    chart({"int8-static": {"torchserve": {"rows": rows}}}, tmp_path / "one.png", 0.8)
    chart({"int8-static": {"torchserve": {"rows": rows}, "mlflow": {"skipped": "no files"}}}, tmp_path / "two.png",
          0.8)
    from PIL import Image

    assert Image.open(tmp_path / "one.png").width < Image.open(tmp_path / "two.png").width


def test_a_server_that_does_not_start_is_recorded_as_a_failed_cell():
    from benchmarks.serve_matrix import failed_or

    def no_server() -> dict:
        raise TimeoutError("['python', '-m', 'serving.mlflow_server'] not ready")

    record = failed_or(no_server)
    assert record == {"failed": "TimeoutError: ['python', '-m', 'serving.mlflow_server'] not ready"}
    assert "| int8-qat | mlflow | failed: TimeoutError" in table({"int8-qat": {"mlflow": record}})
    assert failed_or(lambda: {"rows": []}) == {"rows": []}


def test_a_relative_sqlite_store_is_the_checkouts_one_wherever_the_command_runs(monkeypatch, tmp_path):
    from benchmarks.serve_matrix import ROOT, absolute_store

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert absolute_store("sqlite:///mlflow.db") == f"sqlite:///{ROOT / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///team.db")  # named by the caller: the caller's directory
    assert absolute_store("sqlite:///team.db") == f"sqlite:///{tmp_path.resolve() / 'team.db'}"
    for uri in ("sqlite:////srv/mlflow.db", "http://127.0.0.1:5000", "postgresql://u@h/db"):
        assert absolute_store(uri) == uri


def test_an_empty_variant_list_is_refused_before_anything_is_written(tmp_path, capsys):
    from benchmarks.serve_matrix import main

    with pytest.raises(SystemExit) as exc:
        main(["--variants", ",", "--out", str(tmp_path / "m.json")])
    assert exc.value.code == 2 and "--variants names no variant" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_torchserve_is_started_only_on_a_config_whose_listeners_it_can_move(tmp_path):
    from serving.local_servers import ROOT, torchserve_config

    ports = {"inference": 20001, "management": 20002, "metrics": 20003, "grpc_inference": 20004,
             "grpc_management": 20005}
    shipped = ROOT / "serving" / "config.properties"
    cfg = torchserve_config(shipped, ports, tmp_path / "store")
    assert "inference_address=http://127.0.0.1:20001\n" in cfg and "grpc_management_port=20005\n" in cfg
    assert f"model_store={tmp_path / 'store'}\n" in cfg and ":8080" not in cfg and "7070" not in cfg
    public = tmp_path / "public.properties"
    public.write_text(shipped.read_text().replace("inference_address=http://127.0.0.1:8080",
                                                  "inference_address=http://0.0.0.0:8080"))
    with pytest.raises(ValueError, match="0 lines for inference_address"):
        torchserve_config(public, ports, tmp_path / "store")


def test_the_params_are_read_once_up_front_with_the_store_the_servers_share(monkeypatch, tmp_path):
    from benchmarks.serve_matrix import ROOT, arguments

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    args = arguments(["--variants", "int8-static"])
    assert args.params == ROOT / "params.yaml" and args.settings.package.max_texts > 0
    assert args.store == f"sqlite:///{ROOT / 'mlflow.db'}"
