"""protocol/reach.py: who calls whom, the probe's verdict, the record's reachability, and the relay messages' caps;
peer/swarm/forward.py's choice of addresses to probe; records of peers that predate the NAT fields."""
from __future__ import annotations

import json

import pytest

from gasloc.peer.swarm.forward import probe_addrs
from gasloc.peer.swarm.membership import PeerRecord
from gasloc.protocol.codes import Code
from gasloc.protocol.messages import PROTOCOL_VERSION
from gasloc.protocol.reach import (
    RelayRequest,
    probe_verdict,
    probed_reachability,
    record_reach,
    reprobe_due,
    reprobed_reachability,
    route,
)
from gasloc.protocol.wire import WireError, decode_header, encode_header


def test_who_calls_whom():
    assert route("direct", "direct", []) == "direct"
    assert route("relayed", "direct", []) == "direct"              # a NATed peer can always dial a public one
    assert route("direct", "relayed", ["r"]) == "forwarded"        # through the NATed peer's forwarder
    assert route("direct", "outbound-only", []) is None            # attached to nobody: it calls us
    assert route("relayed", "relayed", ["r"]) == "forwarded"       # NAT <-> NAT: through the callee's forwarder
    assert route("outbound-only", "relayed", ["r"]) == "forwarded"
    assert route("relayed", "outbound-only", []) is None           # nobody can reach it; it may call us


def test_probe_verdict_and_record_reach():
    assert probe_verdict([]) is None
    assert probe_verdict([True, False]) is True and probe_verdict([False, False, True]) is False
    assert record_reach(False, 0) == "direct"
    assert record_reach(True, 0) == "outbound-only" and record_reach(True, 2) == "relayed"


def test_what_auto_concludes_from_the_probe():
    assert probed_reachability(False, 3, []) == (False, "unprobed(loopback only)")   # a one-machine swarm
    assert probed_reachability(True, 0, []) == (False, "unprobed(no peer to ask)")
    assert probed_reachability(True, 2, []) == (False, "unprobed(no prober answered)")
    assert probed_reachability(True, 3, [False, False]) == (True, "probe(0/2 dialled back)")
    assert probed_reachability(True, 2, [True, False]) == (False, "probe(1/2 dialled back)")


def test_relay_request_caps_and_kinds():
    ok = RelayRequest(kind="probe", addrs=(("10.0.0.1", 5),))
    assert decode_header(encode_header(ok)[4:], RelayRequest) == ok
    for bad in ({"kind": "probe", "addrs": [["10.0.0.1", 1]] * 9}, {"kind": "dial"}, {"kind": "forward",
                                                                                       "target": "x" * 129}):
        with pytest.raises(WireError) as e:
            decode_header(json.dumps({"protocol_version": PROTOCOL_VERSION, **bad}).encode(), RelayRequest)
        assert e.value.code == Code.BAD_HEADER


def test_probe_addrs_skip_loopback_unspecified_and_non_tcp():
    got = probe_addrs(["/ip4/127.0.0.1/tcp/5/p2p/x", "/ip4/0.0.0.0/tcp/6", "/ip4/10.77.1.2/tcp/7/p2p/x",
                       "/ip4/10.77.1.2/udp/7/quic-v1", "/ip6/::1/tcp/8", "/ip4/10.77.1.2/tcp/7",
                       "/ip4/10.77.0.1/tcp/4001/p2p/relay/p2p-circuit/p2p/x"])   # the relay's address, not ours
    assert got == [("10.77.1.2", 7)]


def test_when_a_running_peer_probes_again_on_a_virtual_clock():
    a, b = [("10.77.0.101", 4100)], [("10.77.0.101", 4100), ("10.9.0.2", 4100)]
    # checked every 5 s, reprobe_every_s 600: due at the first check at or past 600 s after the last probe
    probed_at, probes = 0.0, []
    for t in range(5, 1900, 5):
        if reprobe_due(float(t), probed_at, 600.0, a, a):
            probes.append(t)
            probed_at = float(t)
    assert probes == [600, 1200, 1800]
    # an address of ours changed (new network, new mapping): at once, whatever the period; same set in another
    # order is no change
    assert reprobe_due(1.0, 0.0, 600.0, b, a) == "addresses changed"
    assert reprobe_due(1.0, 0.0, 600.0, list(reversed(b)), b) is None
    assert reprobe_due(1.0, 0.0, 600.0, [], a) == "addresses changed"   # lost them all: the probe says unprobed
    assert reprobe_due(600.0, 0.0, 600.0, a, a) == "period" and reprobe_due(599.9, 0.0, 600.0, a, a) is None
    # 0: never again, not even when the addresses change
    assert reprobe_due(1e6, 0.0, 0.0, b, a) is None


def test_a_reprobe_that_cannot_decide_keeps_the_current_verdict():
    for private in (True, False):
        assert reprobed_reachability(private, True, 0, []) == (private, "unprobed(no peer to ask)")
        assert reprobed_reachability(private, True, 2, []) == (private, "unprobed(no prober answered)")
        assert reprobed_reachability(private, False, 2, []) == (private, "unprobed(loopback only)")
        assert reprobed_reachability(private, True, 1, [False]) == (True, "probe(0/1 dialled back)")
        assert reprobed_reachability(private, True, 2, [True, False]) == (False, "probe(1/2 dialled back)")


def test_records_without_nat_fields_read_as_direct_and_malformed_claims_as_unreachable():
    base = dict(peer_id="p", protocol=1, fingerprint="f", state="training", round=1, throughput_tps=1.0,
                bandwidth_bps=0.0, time=1.0)
    old = PeerRecord.parse_obj(base)
    assert (old.reach, old.via, old.forwards) == ("direct", [], False)
    assert "reach" not in old.dict()   # nothing added to an older peer's record (the DHT schema check needs that)
    new = PeerRecord.parse_obj({**base, "reach": "relayed", "via": ["r1", 5], "forwards": True})
    assert (new.reach, new.via, new.forwards) == ("relayed", ["r1"], True)
    bad = PeerRecord.parse_obj({**base, "reach": "teleported", "via": "r1", "forwards": "yes"})
    assert (bad.reach, bad.via, bad.forwards) == ("outbound-only", [], False)
