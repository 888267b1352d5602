"""No Docker engine runs here: check what can be checked without one."""

from __future__ import annotations

import re

from tests.factories import ROOT


def _instructions() -> list[tuple[str, str]]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile_parses_and_is_hardened():
    known = {"FROM", "ENV", "RUN", "COPY", "WORKDIR", "USER", "EXPOSE", "HEALTHCHECK", "CMD", "ARG", "LABEL"}
    ins = _instructions()
    assert all(word in known for word, _ in ins), [w for w, _ in ins if w not in known]
    assert ins[0][0] == "FROM" and "slim" in ins[0][1]
    users = [rest for word, rest in ins if word == "USER"]
    assert users and users[-1] not in ("root", "0")
    health = next(rest for word, rest in ins if word == "HEALTHCHECK")
    assert "serving.health" in health  # /ping with the local key, refreshed on expiry
    assert any("serving/health.py" in rest and "serving/client.py" in rest for word, rest in ins if word == "COPY")
    assert "8080" in next(rest for word, rest in ins if word == "EXPOSE")
    assert any("openjdk-17" in rest for word, rest in ins if word == "RUN")


def test_image_serves_with_the_tested_config():
    copies = [rest for word, rest in _instructions() if word == "COPY"]
    assert any("serving/config.properties" in c for c in copies)
    assert any("model_store/sentiment.mar" in c for c in copies)


def test_serving_pins_match_the_lock():
    lock = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)$", (ROOT / "requirements.txt").read_text(), re.M))
    serve = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)$", (ROOT / "requirements-serve.txt").read_text(), re.M))
    assert serve and all(lock.get(k) == v for k, v in serve.items()), {k: (v, lock.get(k)) for k, v in serve.items()}
    assert "torch==2.13.0" in (ROOT / "Dockerfile").read_text()


def test_config_keeps_the_attack_surface_small():
    cfg = dict(line.split("=", 1) for line in (ROOT / "serving" / "config.properties").read_text().splitlines()
               if line and not line.startswith("#"))
    for api in ("inference", "management", "metrics"):
        assert cfg[f"{api}_address"].startswith("http://127.0.0.1:")
    assert cfg["disable_token_authorization"] == "false"
    assert cfg["enable_model_api"] == "false"
    assert cfg["install_py_dep_per_model"] == "false"
    assert cfg["allowed_urls"].startswith("file://")


def test_grpc_ports_stay_on_loopback():
    """TorchServe 0.12 cannot turn its gRPC servers off: they must at least bind to loopback."""
    cfg = dict(line.split("=", 1) for line in (ROOT / "serving" / "config.properties").read_text().splitlines()
               if line and not line.startswith("#"))
    assert cfg["grpc_inference_address"] == cfg["grpc_management_address"] == "127.0.0.1"
    assert "7070" not in next(rest for word, rest in _instructions() if word == "EXPOSE")


def test_the_image_puts_the_proxy_in_front_and_keeps_torchserve_on_loopback():
    ins = _instructions()
    cmd = next(rest for word, rest in ins if word == "CMD")
    assert "nginx -c /home/serve/nginx.conf" in cmd and "--log-config /home/serve/log4j2.xml" in cmd
    assert next(rest for word, rest in ins if word == "EXPOSE").split() == ["8080", "8082"]
    conf = (ROOT / "serving" / "nginx.conf").read_text()
    assert re.search(r"listen 8080;", conf) and re.search(r"server 127\.0\.0\.1:8079;", conf)
    assert any("inference_address=http://127.0.0.1:8079" in rest for word, rest in ins if word == "RUN")
    servers = re.split(r"\n    server \{", conf)[1:]
    public = [block for block in servers if "listen 8080;" in block]
    assert len(public) == 1
    blocks = re.split(r"\n\s*location ", public[0])[1:]
    proxied = [block.split("{", 1)[0].strip() for block in blocks if "proxy_pass" in block]
    assert proxied == ["= /predictions/sentiment"]  # the only path that reaches TorchServe
    assert "if ($request_method != POST)" in blocks[0] and "return 405" in blocks[0]
    # the hop that rewrites TorchServe's own 503 listens on loopback only, on a port the image does not expose
    listens = [re.findall(r"^\s*listen (\S+);", block, re.M) for block in servers if "listen 8080;" not in block]
    assert listens == [["127.0.0.1:8078"]] and "8078" not in next(rest for word, rest in ins if word == "EXPOSE")


def test_torchserve_logs_are_files_that_append_and_rotate():
    import xml.etree.ElementTree as ET

    root = ET.parse(ROOT / "serving" / "log4j2.xml").getroot()
    rolling = root.findall("./Appenders/RollingFile")
    assert {r.get("name") for r in rolling} >= {"access_log", "model_log", "ts_log"}
    for appender in rolling:
        assert appender.get("append") == "true" and appender.find("./Policies/SizeBasedTriggeringPolicy") is not None
    console = root.find("./Appenders/Console/ThresholdFilter")
    assert console is not None and console.get("level") == "WARN"
    loggers = {lg.get("name"): lg for lg in root.findall("./Loggers/Logger")}
    assert loggers["ACCESS_LOG"].get("additivity") == "false"  # per-request lines never reach the console
    makefile = (ROOT / "Makefile").read_text()
    assert "--log-config serving/log4j2.xml >> logs/torchserve.out" in makefile
