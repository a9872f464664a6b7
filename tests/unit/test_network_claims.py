"""The Network's view weighs others' claims against what it observed itself (issue 29): a record that says
"exchanging" for ever leaves the ready set, a record never re-announced leaves the view, donors come in order of
tenure, and round claims far past the swarm are cut (protocol/claims.py, protocol/donors.py)."""
from __future__ import annotations

import pytest

from gasloc.peer.config import PeerConfig
from gasloc.peer.swarm import network as netmod
from gasloc.peer.swarm.membership import PeerRecord
from gasloc.peer.swarm.network import Network, PeerStatus

pytestmark = pytest.mark.timeout(30)


def _rec(pid: str, state: str = "training", round: int = 5, time: float = 1000.0) -> PeerRecord:
    return PeerRecord(peer_id=pid, protocol=2, fingerprint="f", state=state, round=round, throughput_tps=1.0,
                      bandwidth_bps=0.0, time=time)


@pytest.fixture
def clock(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(netmod.time, "monotonic", lambda: now[0])
    return now


def _net(own_round: int = 5, state: str = "training") -> Network:
    net = Network(PeerConfig(), lambda: PeerStatus(state, own_round, 0.0, 0.0, {"round_s": 5.0}))
    net.peer_id = "QmMe"
    return net


def test_a_record_exchanging_for_longer_than_a_round_is_not_ready(clock):
    net = _net()
    net.live = {"sybil": _rec("sybil", "exchanging", 7), "honest": _rec("honest", "training", 7)}
    assert net.ready_peers() == {"sybil"}
    clock[0] += 30
    net.live = {"sybil": _rec("sybil", "exchanging", 7, time=1030.0),       # re-announced, same state and round
                "honest": _rec("honest", "exchanging", 8, time=1030.0)}
    assert net.ready_peers() == {"sybil", "honest"}
    clock[0] += 60                                   # 90 s "exchanging" at round 7: no search lasts that long
    net.live = {"sybil": _rec("sybil", "exchanging", 7, time=1090.0), "honest": _rec("honest", "exchanging", 9)}
    assert net.ready_peers() == {"honest"}
    # a peer-exchange hint that it is ready (an accomplice's, or a peer it keeps calling) does not bring it back
    net.hints.saw("sybil", "exchanging", 7, clock[0])
    assert "sybil" in net.hints.ready(clock[0]) and net.ready_peers() == {"honest"}


def test_a_record_never_re_announced_leaves_the_view(clock):
    net = _net()
    records = {"gone": _rec("gone", time=1000.0), "alive": _rec("alive", time=1000.0)}
    assert set(net._unfrozen(records)) == {"gone", "alive"}
    for step in range(1, 8):
        clock[0] += 10
        records["alive"] = _rec("alive", time=1000.0 + 10 * step)     # an honest peer re-announces
        kept = net._unfrozen(dict(records))
    assert set(kept) == {"alive"}                     # 70 s with the same announcement time > 4 x 15 s


def test_donors_come_in_order_of_tenure_and_claims_past_the_swarm_are_cut(clock):
    net = _net(own_round=20)
    net.live = {p: _rec(p, round=20) for p in ("hA", "hB", "hC")}
    clock[0] += 300
    net.live = {**{p: _rec(p, round=21) for p in ("hA", "hB", "hC")}, "Syb": _rec("Syb", round=10**9)}
    believed = net.believed_rounds()
    assert believed["Syb"] <= 21 + net.cfg.swarm.round_claim_slack and believed["hA"] == 21
    # a donor's reply is held to the cap, not to its listed claim, which is a round or two old when it answers
    # (the e2e resumed peer refused an honest donor replying round 39 against a listed 37)
    caps = net.round_caps()
    assert caps["hA"] >= 21 + net.cfg.swarm.round_claim_slack and caps["Syb"] == believed["Syb"]
    tenure = net.tenure()
    assert tenure["hA"] == pytest.approx(300.0) and tenure["Syb"] == pytest.approx(0.0)
    net.uncallable = lambda: set()
    net._first_listing = lambda: net.live
    order = []
    import gasloc.peer.transport.state_transfer as st
    real = st.download_state

    async def capture(p2p, donors, *a, **k):     # the order download_state is handed; no transfer here
        order.extend(str(d) for d in donors)
        raise st.StateDownloadError("scripted")

    st.download_state = capture
    try:
        budgets = []

        class _Loop:
            def run(self, coro, timeout, stop=None):
                import asyncio
                budgets.append(timeout)
                return asyncio.run(coro)
        net.aio, net.p2p, net.fingerprint = _Loop(), None, "f"
        net.member_out = lambda: None
        import torch
        assert net.download_state([torch.zeros(2_000_000)], _Outer()) is None
    finally:
        st.download_state = real
    # the peer claiming past what we believe is no donor at all (it lies about its round)
    assert sorted(order) == ["hA", "hB", "hC"]
    # the join's budget: join_timeout_s for the waits, plus each candidate's 8 MB at min_rate_mbit (2 Mbit/s: 32 s)
    assert net.cfg.state_transfer.min_rate_mbit == 2.0
    assert budgets == [pytest.approx(net.cfg.swarm.join_timeout_s + 3 * 32.0)]


class _Outer:
    def state_dict(self):
        return {}


def test_after_a_stop_our_stale_round_does_not_anchor_the_peers_seen_anew(clock):
    """A peer frozen longer than the TTL sees every record expire, then sees the swarm anew at rounds it did not
    make. Anchored at its own stale round plus slack, those rounds read as lies and no peer was a donor: the
    resync after the stop found nobody (e2e test_swarm_gossip, once in a fresh clone). Until the daemon handles
    the stop, our round is no vote (as while joining)."""
    from gasloc.peer.swarm.absence import AbsenceWatch

    # not stopped: a peer at round 12 seeing peers anew at 22 believes them 12 + slack (the Sybil rule, as before)
    for away_s, donors in ((0.0, set()), (20.0, {"a", "b", "c"})):
        net = _net(own_round=12)
        t = [0.0]
        net.absence = AbsenceWatch(clock=lambda t=t: t[0])
        t[0] += away_s                                  # the loop did not tick for away_s: a stop
        net.live = {p: _rec(p, round=22) for p in ("a", "b", "c")}     # the swarm went on 10 rounds
        believed = net.believed_rounds()
        got = {p for p, r in believed.items() if r >= 22}
        assert got == donors, (away_s, believed)
