"""`gasloc bootstrap` as a real process: READY line and maddrs file, stable identity, identity in use, clean exit on
SIGTERM/SIGINT, no orphan after kill -9, interoperation with stock hivemind DHT nodes, swarm size in the log."""
from __future__ import annotations

import re
import signal
import socket
import time

import pytest

from e2e.harness import LOOPBACK
from gasloc.peer.swarm.membership import load_identity
from gasloc.runtime.identity import peer_id_of_public

pytestmark = [pytest.mark.timeout(120), pytest.mark.light]

UNUSED_PEER_ID = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"   # a well-formed id no node here has


def maddr_lines(path):
    return [ln for ln in path.read_text().splitlines() if ln and not ln.startswith("#")]


def test_ready_line_and_maddrs_file(harness):
    b = harness.bootstrap("boot", "--log-interval-s", "0.5")
    ready = b.ready
    assert ready["role"] == "bootstrap" and ready["pid"] == b.pid
    assert ready["maddrs"], ready
    for m in ready["maddrs"]:
        assert m.startswith("/ip4/127.0.0.1/tcp/") and m.endswith(f"/p2p/{b.peer_id}"), m
    assert int(ready["maddrs"][0].split("/")[4]) > 0  # port 0 was resolved to a real one
    assert maddr_lines(harness.dir("boot") / "maddrs.txt") == ready["maddrs"]
    # stdout holds exactly the READY line
    assert harness.child("boot").stdout_path.read_text().count("\n") == 1
    # the swarm size is logged periodically
    harness.wait_until(lambda: harness.log("boot").count("swarm run_id=gasloc peers=0") >= 2, 20, "two swarm lines")


def test_default_listen_addresses_are_not_loopback_only(harness):
    b = harness.start("boot", "bootstrap", "--port", "0", "--identity-path", harness.dir("boot") / "id.key")
    kinds = {tuple(m.split("/")[3:4]) for m in b.maddrs}
    assert ("tcp",) in kinds and ("udp",) in kinds, b.maddrs  # TCP and QUIC
    assert any("/quic-v1/" in m for m in b.maddrs)
    # every interface is bound (0.0.0.0): the host's outgoing IPv4 address is announced too, not only loopback
    ips = {m.split("/")[2] for m in b.maddrs}
    assert "127.0.0.1" in ips
    outgoing = outgoing_ipv4()
    if outgoing is not None:
        assert outgoing in ips, (ips, outgoing)


def outgoing_ipv4() -> str | None:
    """The address this host would send from (a UDP connect sends no packet); None without a default route."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))
        except OSError:
            return None
        ip = s.getsockname()[0]
    return None if ip.startswith("127.") else ip


def test_identity_is_stable_across_restarts(harness):
    key = harness.dir("id") / "boot.key"
    first = harness.start("boot1", "bootstrap", "--host-maddrs", LOOPBACK, "--identity-path", key)
    assert key.exists() and (key.stat().st_mode & 0o777) == 0o400
    # the key file's identity (Ed25519, as gasloc makes them), not a random one of p2pd's own
    assert first.peer_id == peer_id_of_public(load_identity(key).public)
    assert harness.stop("boot1") == 0
    second = harness.start("boot2", "bootstrap", "--host-maddrs", LOOPBACK, "--identity-path", key)
    assert second.peer_id == first.peer_id


def test_identity_in_use_is_refused(harness):
    key = harness.dir("id") / "boot.key"
    harness.start("boot1", "bootstrap", "--host-maddrs", LOOPBACK, "--identity-path", key)
    harness.spawn("boot2", "bootstrap", "--host-maddrs", LOOPBACK, "--identity-path", key)
    assert harness.wait_exit("boot2", 60) == 1
    log = harness.log("boot2")
    errors = [ln for ln in log.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1 and "already in use" in errors[0] and "--identity-path" in errors[0], log
    assert "Traceback" not in log
    assert harness.child("boot1").poll() is None  # the first one is unharmed


def test_identity_taken_in_the_swarm_is_refused(harness):
    """A node that joins others with a key already used by one of them: hivemind's own check, our one-line error."""
    key = harness.dir("id") / "boot.key"
    first = harness.start("boot1", "bootstrap", "--host-maddrs", LOOPBACK, "--identity-path", key)
    copy = harness.dir("id2") / "copy.key"  # same key, another file: the local lock does not see it
    copy.write_bytes(key.read_bytes())
    harness.spawn("boot2", "bootstrap", "--host-maddrs", LOOPBACK, "--identity-path", copy,
                  "--initial-peers", first.maddrs[0])
    assert harness.wait_exit("boot2", 60) == 1
    log = harness.log("boot2")
    assert any(ln.startswith("Error:") and "already used by a running node" in ln for ln in log.splitlines()), log
    assert "Traceback" not in log


def test_unreachable_initial_peer_is_named(harness):
    """p2pd gives up when none of the initial peers answers: the error names --initial-peers, not the listen
    address (it once told the operator to check --host-maddrs and the port)."""
    with socket.socket() as s:     # a loopback port nobody listens on: the dial is refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    harness.spawn("boot", "bootstrap", "--host-maddrs", LOOPBACK, "--identity-path", harness.dir("id") / "b.key",
                  "--initial-peers", f"/ip4/127.0.0.1/tcp/{port}/p2p/{UNUSED_PEER_ID}")
    assert harness.wait_exit("boot", 60) == 1
    log = harness.log("boot")
    errors = [ln for ln in log.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1 and "none of --initial-peers answered" in errors[0], log
    assert "--host-maddrs" not in errors[0] and "Traceback" not in log


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_exits_cleanly(harness, sig):
    harness.bootstrap("boot")
    # the tree must hold p2pd before the signal, or the test proves nothing about reaping it; one full-suite run saw
    # the snapshot right after READY without it (passing 2 of 2 alone), so it is polled for
    harness.wait_until(lambda: {"p2pd"} <= {comm for _, comm in harness.tree("boot")}, 10,
                       f"p2pd in the bootstrap's process tree (last seen: {harness.tree('boot')})")
    harness.child("boot").signal(sig)
    t0 = time.monotonic()
    assert harness.wait_exit("boot", 20) == 0
    assert harness.wait_tree_gone("boot", 10), harness.leftovers("boot")
    left = harness.sup.settle()
    assert not left, left
    assert time.monotonic() - t0 < 15
    assert "shutting_down" in harness.log("boot") and "Traceback" not in harness.log("boot")


def test_kill9_leaves_no_process(harness):
    harness.bootstrap("boot")
    harness.kill("boot")
    assert harness.wait_exit("boot", 10) == -signal.SIGKILL
    # the DHT fork dies by PR_SET_PDEATHSIG and p2pd when its control socket closes
    assert harness.wait_tree_gone("boot", 10), harness.leftovers("boot")


def test_stock_dht_nodes_join_through_it_and_it_joins_a_stock_node(harness):
    import hivemind
    from hivemind.utils.timed_storage import get_dht_time

    boot = harness.bootstrap("boot")
    a = b = stock_boot = None
    try:
        # stock clients use our bootstrap
        a = hivemind.DHT(initial_peers=boot.maddrs, start=True, host_maddrs=[LOOPBACK])
        b = hivemind.DHT(initial_peers=boot.maddrs, start=True, host_maddrs=[LOOPBACK])
        assert a.store("e2e_key", "hello", get_dht_time() + 60)
        found = b.get("e2e_key", latest=True)
        assert found is not None and found.value == "hello"
        # and our bootstrap joins a stock DHT node as its initial peer
        stock_boot = hivemind.DHT(start=True, host_maddrs=[LOOPBACK])
        assert stock_boot.store("e2e_key2", "from stock", get_dht_time() + 60)
        ours = harness.start("boot2", "bootstrap", "--host-maddrs", LOOPBACK, "--identity-path",
                             harness.dir("boot2") / "id.key", "--initial-peers",
                             str(stock_boot.get_visible_maddrs()[0]), "--log-interval-s", "0.5")
        c = hivemind.DHT(initial_peers=ours.maddrs, start=True, host_maddrs=[LOOPBACK])
        try:
            found = c.get("e2e_key2", latest=True)
            assert found is not None and found.value == "from stock"
        finally:
            c.shutdown()
        harness.wait_until(lambda: re.search(r"dht_nodes=[1-9]", harness.log("boot2")), 20, "boot2 knows nodes")
    finally:
        for d in (a, b, stock_boot):
            if d is not None:
                d.shutdown()


def test_logs_swarm_size_of_the_run(harness):
    """The count comes from the records peers announce (gasloc.peer.swarm.membership), under --run-id."""
    import asyncio

    import hivemind
    from hivemind.p2p import P2P

    from gasloc.peer.swarm.membership import Membership, load_identity, make_validators

    boot = harness.bootstrap("boot", "--run-id", "e2e-run", "--log-interval-s", "0.5")
    dhts = []
    try:
        for i in range(2):
            # records count only when signed with the announcing node's own libp2p identity key
            key = harness.dir(f"node{i}") / "identity.key"
            P2P.generate_identity(str(key))
            signer, validators = make_validators("e2e-run", load_identity(key))
            dht = hivemind.DHT(initial_peers=boot.maddrs, start=True, host_maddrs=[LOOPBACK],
                               record_validators=validators, identity_path=str(key))
            dhts.append(dht)
            m = Membership(dht, signer, run_id="e2e-run", peer_id=str(dht.peer_id), fingerprint="f", protocol=1,
                           ttl_s=60)
            rec = m.record(state="training", round=3 + i, throughput_tps=1.0, bandwidth_bps=0.0)
            assert asyncio.run(m.announce(rec))
        harness.wait_until(lambda: "swarm run_id=e2e-run peers=2 max_round=4 training=2" in harness.log("boot"),
                           30, "the bootstrap to count both peers")
    finally:
        for d in dhts:
            d.shutdown()


def test_a_peer_refuses_to_start_in_a_swarm_of_single_key_peers(harness):
    """A peer of gasloc before buckets announces under the single key <run>_peers; a newer peer would not see it
    (nor it the newer one), so the newer one refuses to start with one line that says why."""
    import asyncio

    import hivemind
    from hivemind.p2p import P2P
    from hivemind.utils.timed_storage import get_dht_time

    from e2e.swarm_helpers import RUN_ID, write_config
    from gasloc.peer.swarm.membership import Membership, load_identity, make_validators, peers_key

    boot = harness.bootstrap("boot", "--run-id", RUN_ID)
    key = harness.dir("old") / "identity.key"
    P2P.generate_identity(str(key))
    signer, validators = make_validators(RUN_ID, load_identity(key))
    dht = hivemind.DHT(initial_peers=boot.maddrs, start=True, host_maddrs=[LOOPBACK], record_validators=validators,
                       identity_path=str(key))
    try:
        old = Membership(dht, signer, run_id=RUN_ID, peer_id=str(dht.peer_id), fingerprint="f", protocol=1, ttl_s=120)
        rec = old.record(state="training", round=3, throughput_tps=1.0, bandwidth_bps=0.0)
        # exactly what the older peer stored: its record as a subkey of the one key
        assert asyncio.run(old._store(peers_key(RUN_ID), rec.dict(), get_dht_time() + 120))
        r = harness.run("peer", "--config", write_config(harness), "--initial-peers", boot.maddrs[0],
                        "--host-maddrs", LOOPBACK, "--run-dir", harness.dir("new"), timeout_s=180)
        assert r.returncode == 1, r.stderr[-2000:]
        assert f"mixed swarm: 1 peer(s) of run '{RUN_ID}' announce under the single DHT key {RUN_ID}_peers" in r.stderr
        assert "upgrade every peer of the run" in r.stderr and "Traceback" not in r.stderr
    finally:
        dht.shutdown()


def test_bad_config_is_one_line_exit_2(harness, tmp_path):
    cfg = tmp_path / "boot.toml"
    cfg.write_text('prot = 5\n')
    r = harness.run("bootstrap", "--config", cfg, timeout_s=60)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert "unknown key 'prot'" in r.stderr
    r = harness.run("bootstrap", "--announce-maddrs", "/ip4/1.2.3.4/tcp/0", timeout_s=60)
    assert r.returncode == 2 and "port 0" in r.stderr and "Traceback" not in r.stderr, r.stderr
    # a port out of range: a config error before anything starts (it was p2pd's start-up failure, exit 1)
    r = harness.run("bootstrap", "--host-maddrs", "/ip4/127.0.0.1/tcp/99999", timeout_s=60)
    assert r.returncode == 2 and "tcp port '99999'" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = harness.run("bootstrap", "--print-config", "--port", "4001", "--run-id", "x", timeout_s=60)
    assert r.returncode == 0 and "port = 4001" in r.stdout and 'run_id = "x"' in r.stdout
