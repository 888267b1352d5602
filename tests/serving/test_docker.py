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
