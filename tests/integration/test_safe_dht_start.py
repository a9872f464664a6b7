"""A SafeDHT that fails to start raises and leaves no p2pd and no daemon socket behind (runtime/safeproc.py
clean_up_failed_starts), whether its p2pd exits while it starts (no initial peer reachable) or starts and then the
DHT node fails (the initial peer answers no DHT ping). Both left a /tmp/hivemind-p2pd-<uid>.sock before."""
import asyncio
import glob
import os
import socket

import pytest
from hivemind.p2p import P2P

from gasloc.runtime.procs import descendants, process_table
from gasloc.runtime.safeproc import SafeDHT

# a well-formed peer id that no node here has
MADE_UP_PEER_ID = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _p2pd_sockets() -> set[str]:
    return set(glob.glob("/tmp/hivemind-p2pd-*.sock"))


def _our_p2pds() -> set[int]:
    table = process_table()
    return {p for p in descendants({os.getpid()}, table) if table[p].comm == "p2pd" and table[p].state != "Z"}


def _start(initial_peer: str):
    SafeDHT(initial_peers=[initial_peer], start=True, client_mode=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            startup_timeout=30)


@pytest.mark.timeout(90)
def test_a_daemon_that_exits_while_it_starts_leaves_no_socket():
    before = _p2pd_sockets()
    with pytest.raises(Exception, match="Daemon failed to start"):  # then p2pd says why (no bootstrap peer)
        _start(f"/ip4/127.0.0.1/tcp/{_closed_port()}/p2p/{MADE_UP_PEER_ID}")
    assert _p2pd_sockets() - before == set()


@pytest.mark.timeout(90)
def test_a_dht_node_that_fails_after_its_daemon_started_stops_that_daemon():
    loop = asyncio.new_event_loop()
    bare = loop.run_until_complete(P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))   # a libp2p host, no DHT
    try:
        maddr = str(loop.run_until_complete(bare.get_visible_maddrs())[0])
        before, daemons = _p2pd_sockets(), _our_p2pds()
        with pytest.raises(Exception, match="none of the initial_peers responded"):
            _start(maddr)
        assert _p2pd_sockets() - before == set()
        assert _our_p2pds() - daemons == set()
    finally:
        loop.run_until_complete(bare.shutdown())
        loop.close()
