"""Incoming calls meet the same fairness as our own (issue 29: `avoid_recent_partners` applied to our calls only,
and the responder took the first caller with a free offer, so a peer that calls at once every round - an
always-ready Sybil - paired with us every round)."""
from __future__ import annotations

import threading
import time

import pytest

from gasloc.peer.config import PeerConfig
from gasloc.peer.swarm.gossip import GossipAveraging

pytestmark = pytest.mark.timeout(30)


class _Net:
    def __init__(self, live, training=None):
        self.live, self.training = live, training or {}

    def in_sight(self):
        return set(self.live)

    def ready_at(self, now):
        return dict(self.training)


class _Exchanger:
    def rate(self, peer):
        return 0.0


def _gossip(live, training=None) -> GossipAveraging:
    g = GossipAveraging(PeerConfig(), _Net(live, training), stopping=threading.Event(), set_state=lambda s: None)
    g.exchanger = _Exchanger()
    return g


def test_a_caller_that_was_our_last_partner_waits_while_someone_else_is_due():
    g = _gossip({"sybil", "h1", "h2"})
    g.policy.succeeded("sybil")
    g.policy.begin(time.monotonic())
    assert g._declines_peer("sybil")            # first half, others due: BUSY, as our own call would pass it over
    assert g._declines_peer("h1") is None       # a peer we did not just mix with is taken


def test_the_rule_never_leaves_us_without_a_partner():
    g = _gossip({"sybil"})                      # the only peer in sight: taken
    g.policy.succeeded("sybil")
    g.policy.begin(time.monotonic())
    assert g._declines_peer("sybil") is None
    g = _gossip({"sybil", "h1"}, training={"h1": time.monotonic() + 1e6})   # nobody else due in the first half
    g.policy.succeeded("sybil")
    g.policy.begin(time.monotonic())
    assert g._declines_peer("sybil") is None
    g = _gossip({"sybil", "h1"})
    g.policy.succeeded("sybil")
    g.policy.begin(time.monotonic() - 1e3)      # second half of the search: anyone
    assert g._declines_peer("sybil") is None
    g = _gossip({"sybil", "h1"})
    g.policy.succeeded("sybil")                 # no search in progress: nothing to be fair about
    assert g._declines_peer("sybil") is None
