"""The Docker files: the compose file's structure (each node advertises its own peer
address by service name, secrets come from .env, the healthcheck follows the port) and the
Dockerfile's (multi-stage, pinned installs, JSON CMD, non-root). `docker compose config`
and hadolint run too where they are installed."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib

import pytest
import yaml

from kv.cli import build_parser
from kv.cli.settings import serve_settings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCKER = os.path.join(ROOT, "docker")
SECRETS = ("KV_CLUSTER_SECRET", "KV_TOKEN")


def compose() -> dict:
    with open(os.path.join(DOCKER, "compose.yaml")) as f:
        return yaml.safe_load(f)


def dockerfile() -> list[str]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    with open(os.path.join(DOCKER, "Dockerfile")) as f:
        text = re.sub(r"\\\n\s*", " ", f.read())
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_each_node_advertises_its_own_peer_address_by_service_name(monkeypatch):
    services = compose()["services"]
    assert sorted(services) == ["n1", "n2", "n3"]
    for name, svc in services.items():
        env = svc["environment"]
        for k in list(os.environ):
            if k.startswith("KV_"):
                monkeypatch.delenv(k)
        for k, v in env.items():
            monkeypatch.setenv(k, "a-secret" if k in SECRETS else str(v))
        args = build_parser().parse_args(svc.get("command", ["serve"]))
        config = serve_settings(args).node  # the node would accept these settings
        assert config.id == name
        assert config.peers == {s: f"{s}:9001" for s in services}  # itself too: never 0.0.0.0
        port = config.http.rpartition(":")[2]
        assert config.advertise_url == f"http://{name}:{port}"
        assert any(p.endswith(f":{port}") for p in svc["ports"])


def test_secrets_come_from_the_env_file():
    for svc in compose()["services"].values():
        for k in SECRETS:
            assert re.fullmatch(r"\$\{%s:\?[^}]+\}" % k, svc["environment"][k]), svc["environment"][k]
    with open(os.path.join(DOCKER, ".env.example")) as f:
        example = dict(line.split("=", 1) for line in f.read().splitlines() if line and not line.startswith("#"))
    assert set(example) == set(SECRETS)
    with open(os.path.join(ROOT, ".gitignore")) as f:
        assert "/docker/.env" in f.read().split()


def test_the_healthcheck_follows_the_configured_port():
    check = ["CMD", "python", "-m", "kv.healthcheck"]  # reads KV_HTTP, as kv serve does
    for svc in compose()["services"].values():
        assert svc["healthcheck"]["test"] == check and "KV_HTTP" in svc["environment"]
    lines = dockerfile()
    (health,) = [line for line in lines if line.startswith("HEALTHCHECK")]
    assert health.endswith('CMD ["python", "-m", "kv.healthcheck"]')
    assert not any("8001/healthz" in line for line in lines)


def test_dockerfile_is_multi_stage_pinned_json_and_non_root():
    lines = dockerfile()
    stages = [i for i, line in enumerate(lines) if line.startswith("FROM ")]
    assert len(stages) >= 2
    final = lines[stages[-1]:]
    assert not any(line.startswith("RUN") and "pip install" in line for line in final)  # nothing built in the runtime stage
    users = [line.split()[1] for line in final if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")
    for kw in ("CMD", "ENTRYPOINT"):
        (line,) = [line for line in final if line.startswith(kw + " ")]
        assert line[len(kw) + 1:].startswith("["), line  # JSON (exec) form
    for line in lines:
        if "pip install" in line:
            assert "--requirement docker/requirements.txt" in line or line.endswith("--no-deps ."), line
    with open(os.path.join(DOCKER, "requirements.txt")) as f:
        reqs = [line.split("#")[0].strip() for line in f if line.split("#")[0].strip()]
    assert all(re.fullmatch(r"[A-Za-z0-9_.\-]+==[0-9][A-Za-z0-9.]*", r) for r in reqs), reqs
    pinned = {r.split("==")[0].lower().replace("_", "-") for r in reqs}
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    for dep in project["dependencies"] + project["optional-dependencies"]["speed"]:
        assert re.match(r"[A-Za-z0-9_.\-]+", dep).group(0).lower().replace("_", "-") in pinned, dep
    copied = {line.split()[1] for line in lines if line.startswith("COPY") and "--from" not in line}
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        folders = tomllib.load(f)["tool"]["setuptools"]["package-dir"].values()
    assert set(folders) <= copied, f"the image leaves out {set(folders) - copied} (pyproject's package-dir)"
    for line in lines:
        if line.startswith("COPY") and "--from" not in line:
            for src in line.split()[1:-1]:
                assert os.path.exists(os.path.join(ROOT, src)), src


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="hadolint is not installed")
def test_hadolint():
    r = subprocess.run(["hadolint", os.path.join(DOCKER, "Dockerfile")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def _has_compose() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _has_compose(), reason="docker compose is not installed")
def test_docker_compose_config():
    env = {**os.environ, "KV_CLUSTER_SECRET": "s", "KV_TOKEN": "t"}
    r = subprocess.run(["docker", "compose", "-f", os.path.join(DOCKER, "compose.yaml"), "config", "--quiet"], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    env.pop("KV_TOKEN")
    r = subprocess.run(["docker", "compose", "-f", os.path.join(DOCKER, "compose.yaml"), "--env-file", os.devnull, "config", "--quiet"], capture_output=True, text=True, env=env)
    assert r.returncode != 0 and "KV_TOKEN" in r.stderr
