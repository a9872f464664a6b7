"""`gasloc swarm` (the README demo) as a real process: it trains, summarizes, plots and leaves nothing behind;
Ctrl+C stops it the same way; a peer that fails makes it exit 1."""
from __future__ import annotations

import json

import pytest
import torch

from gasloc.peer.train.model import ModelConfig, build_model
from gasloc.protocol.codec import DEFAULT_CODEC, parse, probe_numel, probe_text


def assert_nothing_left(harness, name):
    assert harness.wait_tree_gone(name, 15), harness.leftovers(name)
    left = harness.sup.settle()
    assert not left.processes and not left.sockets, left


def read_summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def assert_png(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, (path, len(data))


@pytest.mark.timeout(300)
def test_swarm_trains_summarizes_plots_and_cleans_up(harness):
    run_dir = harness.run_dir / "demo"
    # a GASLOC_* variable for the peers only: the swarm's bootstrap must not see it (it would reject the key)
    harness.spawn("swarm", "swarm", "--peers", "2", "--duration", "25", "--run-dir", run_dir,
                  env={"GASLOC_RUN__EVAL_EVERY_ROUNDS": "1"})
    assert harness.wait_exit("swarm", 240) == 0, harness.log("swarm")
    out = harness.child("swarm").stdout_path.read_text()
    assert "summary" in out and "peer-0" in out and "peer-1" in out, out
    assert "live status page: http://127.0.0.1:" in out, out  # gasloc status --serve ran beside the peers

    s = read_summary(run_dir)
    assert s["failed"] == [] and s["bootstrap_exit"] == 0
    for me, other in (("peer-0", "peer-1"), ("peer-1", "peer-0")):
        p = s["peers"][me]
        assert p["status"] == "stopped", p
        assert p["rounds"] >= 2, p
        assert p["exchanges_ok"] >= 1 and p["partners"] == [other], p
        assert p["last_loss"] < p["first_loss"], p
        rounds = [json.loads(line) for line in (run_dir / me / "metrics.jsonl").read_text().splitlines()]
        assert all(r["val_loss"] is not None for r in rounds if r["event"] == "round")  # the variable reached it
        # the default wire codec, and the bytes it sent: an exchange (one attempt) is the codec's payload, a
        # modulo codec's probe in our header (64 float32 values a tensor, base64) and headers and verdicts of a few
        # KB (mod4-sd: 0.52 bytes a parameter; int8 was 1.03, fp32 4.0)
        start = next(r for r in rounds if r["event"] == "start")
        assert start["codec"] == DEFAULT_CODEC, start
        codec = parse(DEFAULT_CODEC)
        payload = codec.bits_per_param([64]) / 8 * start["num_params"]   # tiny: whole blocks
        if codec.modulo:
            numels = [p.numel() for p in build_model(ModelConfig(preset="tiny"), 256, seed=0).parameters()]
            payload += len(probe_text(torch.zeros(probe_numel(numels))))
        sent = [r["bytes_sent"] for r in rounds
                if r["event"] == "round" and r["outcome"] == "ok" and r.get("attempts") == 1]
        assert sent and all(payload < b < payload + 16_384 for b in sent), (payload, sent)
        assert max(sent) / start["num_params"] <= 0.55   # issue 32's live target, headers included
    assert_png(run_dir / "swarm.png")
    # the documented layout
    for f in ("bootstrap.maddrs", "bootstrap.log", "status.log", "peer-0/metrics.jsonl", "peer-0/peer.log",
              "peer-1/metrics.jsonl", "peer-1/peer.log"):
        assert (run_dir / f).is_file(), f
    # every process of the swarm's tree (bootstrap, peers, their DHT forks and p2pds) is gone, no socket left
    comms = [c for _, c in harness.tree("swarm")]
    assert comms.count("p2pd") >= 3, comms  # the harness really saw the trees it now checks
    assert_nothing_left(harness, "swarm")


@pytest.mark.light  # stopped at its first round or sooner: what is tested is the stop
@pytest.mark.timeout(240)
def test_ctrl_c_stops_with_a_summary(harness, tmp_path):
    run_dir = harness.run_dir / "demo"
    peer_toml = tmp_path / "peer.toml"
    peer_toml.write_text("[inner]\ninner_steps = 7\n")  # reaches every peer through --peer-config
    harness.spawn("swarm", "swarm", "--peers", "2", "--duration", "0", "--run-dir", run_dir, "--peer-config",
                  peer_toml)
    harness.wait_until(lambda: any(r.get("event") == "round" for r in harness.metrics("demo/peer-0")), 150,
                       "peer-0's first round", alive=("swarm",))
    harness.interrupt("swarm")
    assert harness.wait_exit("swarm", 60) == 0, harness.log("swarm")
    rounds = [r for r in harness.metrics("demo/peer-0") if r.get("event") == "round"]
    assert rounds[0]["inner_steps"] == 7, rounds[0]  # (a round cut short by the stop has fewer)
    s = read_summary(run_dir)
    assert s["failed"] == [] and all(p["status"] == "stopped" for p in s["peers"].values()), s
    assert_png(run_dir / "swarm.png")
    assert_nothing_left(harness, "swarm")


@pytest.mark.light  # stopped at its first round or sooner: what is tested is the stop
@pytest.mark.timeout(240)
def test_kill9_of_the_swarm_command_stops_its_children(harness):
    """Even SIGKILL of `gasloc swarm` leaves nothing: its children get SIGTERM from the kernel (PR_SET_PDEATHSIG)
    and shut down cleanly."""
    run_dir = harness.run_dir / "demo"
    harness.spawn("swarm", "swarm", "--peers", "2", "--duration", "0", "--run-dir", run_dir)
    harness.wait_until(lambda: "peers ready" in harness.child("swarm").stdout_path.read_text(), 150,
                       "the peers to be ready", alive=("swarm",))
    assert {"p2pd"} <= {c for _, c in harness.tree("swarm")}
    harness.kill("swarm")
    assert harness.wait_tree_gone("swarm", 60), harness.leftovers("swarm")
    for name in ("peer-0", "peer-1"):
        stops = [r for r in harness.metrics(f"demo/{name}") if r.get("event") == "stop"]
        assert stops and stops[-1]["reason"] == "SIGTERM", (name, stops)


@pytest.mark.light
@pytest.mark.timeout(120)
def test_failing_peer_makes_it_exit_1(harness):
    """Arguments after -- go to every peer: an invalid one makes each peer exit 2 before READY."""
    run_dir = harness.run_dir / "demo"
    harness.spawn("swarm", "swarm", "--peers", "2", "--duration", "30", "--run-dir", run_dir, "--",
                  "--max-rounds", "0")
    assert harness.wait_exit("swarm", 90) == 1
    out = harness.child("swarm").stdout_path.read_text()
    assert "exited with code 2 before READY" in out and "max_rounds" in out, out
    assert "failed:" in out
    assert_nothing_left(harness, "swarm")


@pytest.mark.light
def test_refuses_non_empty_run_dir_and_bad_options(harness):
    run_dir = harness.run_dir / "used"
    run_dir.mkdir()
    (run_dir / "old.txt").write_text("x")
    r = harness.run("swarm", "--peers", "2", "--run-dir", run_dir, timeout_s=60)
    assert r.returncode == 2 and "is not empty" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = harness.run("swarm", "--peers", "0", timeout_s=60)
    assert r.returncode == 2 and "'peers'" in r.stderr, r.stderr
    r = harness.run("swarm", "--print-config", "--peers", "3", timeout_s=60)
    assert r.returncode == 0 and "peers = 3" in r.stdout
