"""A SafeDHT that fails to start raises and leaves no p2pd and no daemon socket behind (runtime/safeproc.py
clean_up_failed_starts), whether its p2pd exits while it starts (no initial peer reachable) or starts and then the
DHT node fails (the initial peer answers no DHT ping). Both left a /tmp/hivemind-p2pd-<uid>.sock before."""
import asyncio
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from e2e.harness import MADE_UP_PEER_ID, free_port
from hivemind.p2p import P2P

from gasloc.runtime.procs import descendants, process_table
from gasloc.runtime.safeproc import SafeDHT


@pytest.fixture
def sock_dir(monkeypatch):
    """A directory of this test's own for the sockets of every p2pd it starts (the forked DHT child inherits the
    prefix): other tests' daemons, running beside it under pytest-xdist, bind theirs in /tmp. Short, for the
    108-byte limit of a unix socket path."""
    d = Path(tempfile.mkdtemp(prefix="gsd-"))
    monkeypatch.setattr(P2P, "_UNIX_SOCKET_PREFIX", f"/unix{d}/hivemind-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _p2pd_sockets(d: Path) -> set[Path]:
    return set(d.glob("hivemind-p2pd-*.sock"))


def _our_p2pds() -> set[int]:
    table = process_table()
    return {p for p in descendants({os.getpid()}, table) if table[p].comm == "p2pd" and table[p].state != "Z"}


def _start(initial_peer: str):
    SafeDHT(initial_peers=[initial_peer], start=True, client_mode=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            startup_timeout=30)


@pytest.mark.timeout(90)
def test_a_daemon_that_exits_while_it_starts_leaves_no_socket(sock_dir):
    with pytest.raises(Exception, match="failed to connect to bootstrap peers"):   # p2pd's own words
        _start(f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{MADE_UP_PEER_ID}")
    assert _p2pd_sockets(sock_dir) == set()


@pytest.mark.timeout(90)
def test_a_dht_node_that_fails_after_its_daemon_started_stops_that_daemon(sock_dir):
    loop = asyncio.new_event_loop()
    bare = loop.run_until_complete(P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))   # a libp2p host, no DHT
    try:
        maddr = str(loop.run_until_complete(bare.get_visible_maddrs())[0])
        before, daemons = _p2pd_sockets(sock_dir), _our_p2pds()
        with pytest.raises(Exception, match="none of the initial_peers responded"):
            _start(maddr)
        assert _p2pd_sockets(sock_dir) == before   # the bare host's own
        assert _our_p2pds() - daemons == set()
    finally:
        loop.run_until_complete(bare.shutdown())
        loop.close()


@pytest.mark.timeout(60)
def test_doctor_whose_p2pd_is_slower_than_its_timeout_stops_that_p2pd(sock_dir):
    """`gasloc doctor --timeout-s` shorter than p2pd's start (50 ms; it takes some 0.3 s here): a FAIL line, and the
    daemon it spawned is gone. With a wait_for around P2P.create the cancelled create left that p2pd running (it
    exits on its own only after its idle timeout) and its socket behind."""
    from gasloc.cli.doctor_checks import _network

    daemons = _our_p2pds()
    checks = asyncio.run(_network([], [], False, 0.05, 5.0))
    assert [(c.name, c.status) for c in checks] == [("p2pd", "FAIL")], checks
    assert "did not start" in checks[0].detail
    assert _our_p2pds() - daemons == set()
    assert _p2pd_sockets(sock_dir) == set()


@pytest.mark.timeout(90)
def test_a_dht_runs_with_an_ed25519_identity_file_and_its_peer_id_is_the_one_records_derive(sock_dir, tmp_path):
    """p2pd takes gasloc's Ed25519 identity files (runtime/identity.py) and reports the peer id that a record's owner
    key derives to; with initial peers, hivemind's check that the identity is not taken reads such a file too
    (safeproc.read_ed25519_identity_files: it parsed every file as RSA and failed the start)."""
    from gasloc.peer.swarm.membership import make_validators, peer_id_of
    from gasloc.runtime.identity import write_identity_file

    first = SafeDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], startup_timeout=30)
    try:
        path = tmp_path / "ed.key"
        ident = write_identity_file(path)
        dht = SafeDHT(initial_peers=[str(m) for m in first.get_visible_maddrs()], start=True,
                      host_maddrs=["/ip4/127.0.0.1/tcp/0"], identity_path=str(path), startup_timeout=30)
        try:
            signer, _ = make_validators("run", ident)
            assert dht.peer_id.to_base58() == peer_id_of(signer.local_public_key)
        finally:
            dht.shutdown()
    finally:
        first.shutdown()
