"""The Docker path as a volunteer takes it: docker/build.sh builds the image (a stand-in base and a local wheelhouse
where nothing can be pulled), `gasloc --help` and `gasloc doctor` run in it, and docker-compose.yml's bootstrap and
two peers (its CPU form: the file as it is) train for a fixed number of rounds, become healthy, stop cleanly on
`docker stop` with a checkpoint in their volume, and a peer started again on that volume resumes from it.

Needs a Docker engine: it uses a running one, else starts dockerd itself when it can (root) and stops it at the end,
then puts back what that dockerd changed on the host (its bridge, iptables rules and sysctls: tests/e2e/dockerd_host.py).
Where there is none it skips with the reason on a developer's machine, and fails under CI (CI set, as .ci/run does).
Everything it creates (a compose project of its own: containers, network, volumes) is removed, also on failure;
a project that a killed earlier run left (its pytest process gone) is removed before the swarm starts.

Two tests: the build and the one-off containers (light: `make test` runs it beside the unit tests, where a cold build's
downloads and layer writes overlap their CPU work), and the compose swarm, which runs alone and builds again first (a
cache hit once the image is built, and the image of the source at hand either way).
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from e2e import dockerd_host
from gasloc.runtime.jsonl import parse_jsonl

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "gasloc:latest"  # the tag docker-compose.yml runs
ROUNDS = 10  # judged over each peer's first ROUNDS rounds, not over seconds (the machine's load varies)
MIN_OK = 5
STOP_GRACE_S = 60  # docker-compose.yml's stop_grace_period for the peers
T = TypeVar("T")

# one worker for both under pytest-xdist: each may start the engine (the module-scoped `engine` fixture)
pytestmark = [pytest.mark.docker, pytest.mark.xdist_group("docker")]


def sh(*args: str, timeout_s: float = 120, check: bool = True, env: dict[str, str] | None = None
       ) -> subprocess.CompletedProcess:
    r = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, env=env)
    if check and r.returncode != 0:
        pytest.fail(f"{' '.join(args)} exited {r.returncode}: {(r.stdout + r.stderr)[-3000:]}", pytrace=False)
    return r


def wait_until(fn: Callable[[], T | None], timeout_s: float, what: str, every_s: float = 2.0) -> T:
    deadline = time.monotonic() + timeout_s
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}", pytrace=False)
        time.sleep(every_s)


def _not_here(reason: str) -> None:
    """Under CI a missing engine is a failure of the setup, never a silent skip."""
    if os.environ.get("CI"):
        pytest.fail(f"CI: {reason}", pytrace=False)
    pytest.skip(reason)


def _engine_answers() -> bool:
    return subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode == 0


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Iterator[None]:
    """A Docker engine that answers: the running one, or a dockerd started here and stopped afterwards."""
    if shutil.which("docker") is None:
        _not_here("no docker client (apt-get install docker.io; .ci/run does)")
    if _engine_answers():
        yield
        return
    if os.geteuid() != 0:
        _not_here("no Docker engine running, and starting one needs root")
    if shutil.which("dockerd") is None:
        _not_here("no Docker engine running and no dockerd installed (apt-get install docker.io; .ci/run does)")
    log = tmp_path_factory.mktemp("dockerd") / "dockerd.log"
    host = dockerd_host.snapshot()   # its bridge, iptables rules and sysctls are undone once it has stopped
    with open(log, "w") as out:
        proc = subprocess.Popen(["dockerd", "--storage-driver=overlay2"], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not _engine_answers():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"dockerd did not start (exit {proc.poll()}): {log.read_text()[-2000:]}", pytrace=False)
            time.sleep(0.5)
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        dockerd_host.restore(host)


def compose_client() -> list[str]:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30).returncode == 0:
        return ["docker", "compose"]
    _not_here("no compose client (apt-get install docker-compose; .ci/run does)")
    raise AssertionError("unreachable")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        return s.getsockname()[1]


class Project:
    """One compose project of this test's own (its name keeps it apart from anything else on the engine)."""

    def __init__(self, tmp_path: Path):
        self.name = f"{PROJECT_PREFIX}{os.getpid()}"
        # Test-only settings on top of the unchanged file: one thread per process and 5 inner steps a round
        # instead of 20 (2 cores shared by three containers and other tests), a checkpoint every 5 rounds, a
        # free host port for the bootstrap instead of 31337, and no restart policy: the file's unless-stopped
        # brought back a killed test run's containers, which then trained for hours beside later runs whenever an
        # engine started (seen here: a project 11 hours old, up again with the engine .ci/run started).
        peer_env = ("{restart: 'no', environment: {OMP_NUM_THREADS: '1', GASLOC_INNER__INNER_STEPS: '5', "
                    "GASLOC_CHECKPOINT__EVERY_ROUNDS: '5'}}")
        override = tmp_path / "compose.test.yml"
        override.write_text(
            "services:\n"
            "  bootstrap: {restart: 'no', environment: {OMP_NUM_THREADS: '1'}}\n"
            f"  peer1: {peer_env}\n"
            f"  peer2: {peer_env}\n")
        self.cmd = compose_client() + ["-p", self.name, "-f", str(ROOT / "docker-compose.yml"), "-f", str(override)]
        self.env = {**os.environ, "BOOTSTRAP_HOST_PORT": str(free_port())}

    def compose(self, *args: str, timeout_s: float = 180) -> str:
        return sh(*self.cmd, *args, timeout_s=timeout_s, env=self.env).stdout

    def container(self, service: str) -> str:
        cid = self.compose("ps", "-q", service).strip()
        assert cid, f"no container for {service}"
        return cid

    def leftovers(self) -> dict[str, list[str]]:
        return project_objects(self.name)

    def down(self) -> None:
        sh(*self.cmd, "down", "--volumes", "--remove-orphans", "--timeout", "10", timeout_s=180, check=False,
           env=self.env)


PROJECT_PREFIX = "gasloc-test-"  # + the PID of the pytest process that made the project
_LIST = {"containers": ["ps", "-a"], "volumes": ["volume", "ls"], "networks": ["network", "ls"]}  # docker commands


def project_objects(name: str) -> dict[str, list[str]]:
    """The containers, volumes and networks of one compose project, by compose's project label."""
    label = f"label=com.docker.compose.project={name}"
    found = {kind: sh("docker", *ls, "-q", "--filter", label, check=False).stdout.split() for kind, ls in _LIST.items()}
    return {k: v for k, v in found.items() if v}


def remove_stale_projects() -> list[str]:
    """Remove the compose projects of earlier test runs whose pytest process is gone: a run killed before its own
    `down` (SIGKILL, a machine stopped) leaves its containers and volumes on the engine. A project of a live
    process (another test run on this engine) is left alone."""
    names = {name for ls in _LIST.values()
             for name in sh("docker", *ls, "--filter", "label=com.docker.compose.project",
                            "--format", '{{.Label "com.docker.compose.project"}}').stdout.split()}
    stale = sorted(n for n in names if n.startswith(PROJECT_PREFIX) and n[len(PROJECT_PREFIX):].isdigit()
                   and not Path(f"/proc/{n[len(PROJECT_PREFIX):]}").exists())
    for name in stale:
        objs = project_objects(name)
        if objs.get("containers"):   # -v: the anonymous volumes of the image's VOLUME paths go with them
            sh("docker", "rm", "-f", "-v", *objs["containers"])
        if objs.get("networks"):
            sh("docker", "network", "rm", *objs["networks"])
        if objs.get("volumes"):
            sh("docker", "volume", "rm", *objs["volumes"])
    return stale


def inspect(cid: str) -> dict:
    return json.loads(sh("docker", "inspect", cid).stdout)[0]


def health(cid: str) -> str:
    return inspect(cid)["State"].get("Health", {}).get("Status", "none")


def metrics(cid: str) -> list[dict]:
    """The peer's metrics.jsonl records (a torn last line is skipped)."""
    r = sh("docker", "exec", cid, "cat", "/data/run/metrics.jsonl", check=False)
    return parse_jsonl(r.stdout.splitlines())


def events(records: list[dict], event: str) -> list[dict]:
    return [r for r in records if r.get("event") == event]


def volume_of(cid: str, destination: str) -> str:
    return next(m["Name"] for m in inspect(cid)["Mounts"] if m["Destination"] == destination)


def checkpoint_rounds(volume: str) -> list[int]:
    """Rounds of the checkpoints in a volume, read by a throwaway container (the peer's is stopped)."""
    script = ("import json, pathlib; print(json.dumps(sorted(json.loads((p / 'meta.json').read_text())['round'] "
              "for p in pathlib.Path('/c').glob('ckpt-*') if (p / 'meta.json').is_file())))")
    out = sh("docker", "run", "--rm", "-v", f"{volume}:/c:ro", "--entrypoint", "python", IMAGE, "-c", script).stdout
    return json.loads(out)


def build_image() -> subprocess.CompletedProcess:
    t0 = time.monotonic()
    # the wheelhouse is collected by this Python (3.11, with pip and the machine's pip settings)
    build = sh("bash", str(ROOT / "docker" / "build.sh"), "--tag", IMAGE, timeout_s=540,
               env={**os.environ, "PYTHON": sys.executable})
    print(f"\nbuild {time.monotonic() - t0:.0f} s")
    return build


@pytest.mark.light
@pytest.mark.timeout(900)  # cold: the stand-in base, the wheelhouse and every layer built (target 8 min)
def test_image_builds_and_runs_help_and_doctor(engine):
    build_image()
    image = json.loads(sh("docker", "image", "inspect", IMAGE).stdout)[0]
    print(f"image {image['Size'] / 1e9:.2f} GB")
    # pip's build-time settings are ARGs: none of them stays in the image's environment
    env = image["Config"]["Env"]
    assert not [e for e in env if e.split("=")[0] in {"PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS",
                                                       "PIP_NO_INDEX", "PIP_TRUSTED_HOST", "PIP_CERT"}], env
    assert image["Config"]["User"] == "10001:10001"

    r = sh("docker", "run", "--rm", IMAGE, "--help")
    assert "peer" in r.stdout and "bootstrap" in r.stdout, r.stdout
    r = sh("docker", "run", "--rm", IMAGE, "doctor", "--timeout-s", "5", "--checkpoint-dir", "/data/checkpoints",
           check=False)
    assert r.returncode == 0 and "FAIL" not in r.stdout and "Traceback" not in r.stderr, r.stdout + r.stderr


@pytest.mark.timeout(900)  # cold, when it runs without the test above: the whole build first
def test_compose_swarm_trains_stops_and_resumes(engine, tmp_path):
    build = build_image()
    stale = remove_stale_projects()
    if stale:
        print(f"removed the compose projects of earlier, killed runs: {stale}")
    project = Project(tmp_path)
    try:
        project.compose("up", "-d", "--no-build")
        ids = {s: project.container(s) for s in ("bootstrap", "peer1", "peer2")}
        peers = ("peer1", "peer2")

        def rounds_done():
            recs = {p: events(metrics(ids[p]), "round") for p in peers}
            return recs if all(len(r) >= ROUNDS for r in recs.values()) else None

        rounds = wait_until(rounds_done, 480, f"{ROUNDS} rounds of each peer", every_s=3)
        for p in peers:
            ok = sum(r.get("outcome") == "ok" for r in rounds[p][:ROUNDS])
            assert ok >= MIN_OK, (p, [(r.get("outcome"), r.get("detail")) for r in rounds[p][:ROUNDS]],
                                  sh("docker", "logs", ids[p], check=False).stderr[-6000:])
        # every container healthy by its own check (the peers' first runs 30 s after their start)
        wait_until(lambda: all(health(c) == "healthy" for c in ids.values()), 120, "all three healthy",
                   every_s=3)
        states = {s: health(c) for s, c in ids.items()}

        # docker stop: SIGTERM, the peer finishes its round, writes a checkpoint and exits 0 within the grace
        t = time.monotonic()
        sh("docker", "stop", "--time", str(STOP_GRACE_S), ids["peer1"], timeout_s=STOP_GRACE_S + 30)
        stop_s = time.monotonic() - t
        state = inspect(ids["peer1"])["State"]
        assert state["ExitCode"] == 0 and not state["OOMKilled"] and stop_s < STOP_GRACE_S, (state, stop_s)
        ckpts = checkpoint_rounds(volume_of(ids["peer1"], "/data/checkpoints"))
        assert ckpts and ckpts[-1] >= ROUNDS, ckpts

        # the same container again, on the same volumes: it resumes from the newest checkpoint
        sh("docker", "start", ids["peer1"])
        start = wait_until(lambda: (s := events(metrics(ids["peer1"]), "start")) and len(s) == 2 and s[-1], 120,
                           "peer1's start record after the restart")
        assert start["round"] == ckpts[-1], (start, ckpts)
        first = events(metrics(ids["peer1"]), "start")[0]
        assert start["initial_loss"] < first["initial_loss"] - 1.0, (first, start)  # a trained model, not a new one

        codes = {}
        for s in ("peer1", "peer2", "bootstrap"):
            t = time.monotonic()
            sh("docker", "stop", "--time", str(STOP_GRACE_S), ids[s], timeout_s=STOP_GRACE_S + 30)
            codes[s] = (inspect(ids[s])["State"]["ExitCode"], round(time.monotonic() - t, 1))
        print(f"health {states}; first stop of peer1 {stop_s:.1f} s, checkpoints {ckpts}; resumed at round "
              f"{start['round']}; exit codes (code, stop s) {codes}")
        assert all(code == 0 for code, _ in codes.values()), codes
    finally:
        project.down()
    left = project.leftovers()
    assert not left, f"compose project {project.name} left {left}"
    assert build.returncode == 0
