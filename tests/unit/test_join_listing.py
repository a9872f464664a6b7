"""A joiner's first listing (peer/swarm/joining.py `_first_listing`): an empty one is taken again while initial
peers are set, so a joiner whose DHT node does not know the swarm yet does not start from the seed model."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from gasloc.peer.config import PeerConfig
from gasloc.peer.swarm import joining as joining_mod
from gasloc.peer.swarm.network import Network, PeerStatus

REC = SimpleNamespace(state="training", round=3, time=100.0)


def _net(initial_peers: list[str], listings: list[dict], wait_s: float = 3.0) -> tuple[Network, list[int]]:
    cfg = PeerConfig()
    cfg.network.initial_peers = initial_peers
    cfg.swarm.join_listing_wait_s = wait_s
    # only the listing side is exercised: no DHT, no loop
    net = Network(cfg, lambda: PeerStatus("joining", 0, 0.0, 0.0))
    calls = [0]

    def refresh():
        calls[0] += 1
        net.live = listings.pop(0) if listings else {}

    net.refresh_listing = refresh
    return net, calls


@pytest.fixture(autouse=True)
def fast_period(monkeypatch):
    monkeypatch.setattr(joining_mod, "JOIN_RELIST_S", 0.01)


def test_an_empty_first_listing_is_taken_again_until_the_swarm_shows():
    net, calls = _net(["/ip4/127.0.0.1/tcp/1/p2p/QmBoot"], [{}, {}, {"peerA": REC}])
    assert net._first_listing() == {"peerA": REC}
    assert calls[0] == 3


def test_no_initial_peers_means_a_new_swarm_and_no_wait():
    net, calls = _net([], [{"peerA": REC}])
    assert net._first_listing() == {}
    assert calls[0] == 0


def test_a_listing_that_names_anyone_is_used_at_once():
    net, calls = _net(["/ip4/127.0.0.1/tcp/1/p2p/QmBoot"], [])
    net.live = {"peerB": REC}
    assert net._first_listing() == {"peerB": REC}
    assert calls[0] == 0


def test_the_wait_is_bounded():
    net, calls = _net(["/ip4/127.0.0.1/tcp/1/p2p/QmBoot"], [], wait_s=0.05)
    assert net._first_listing() == {}
    assert 1 <= calls[0] <= 10
