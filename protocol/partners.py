"""Partner choice for a live GASLoC peer: who to ask next, and who not to ask for a while. Pure: no I/O, no clock
(times are passed in), so it is unit-tested directly.

Backoff (petals style, explicit bounds): a partner whose exchange failed or timed out is not asked again for
min_backoff_s * 2^(failures-1), capped at max_backoff_s, with +-jitter so a swarm does not retry in lockstep.
A partner that answered BUSY is alive and well, only engaged: it is skipped for a short fixed cooldown and its
failure count is untouched. A successful exchange clears the record.
"""
from __future__ import annotations

import random
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from gasloc.protocol.matching import choose_partner


@dataclass
class Backoff:
    min_backoff_s: float
    max_backoff_s: float
    busy_cooldown_s: float
    jitter: float = 0.2
    failures: dict[str, int] = field(default_factory=dict)
    until: dict[str, float] = field(default_factory=dict)          # not called before: a failure's backoff or a BUSY
    failed_until: dict[str, float] = field(default_factory=dict)   # the failure's backoff alone (backing_off)

    def failed(self, peer: str, now: float, rng: random.Random) -> float:
        """Record a failure (timeout, error, rejection); returns the backoff chosen in seconds."""
        n = self.failures.get(peer, 0) + 1
        self.failures[peer] = n
        delay = min(self.max_backoff_s, self.min_backoff_s * 2 ** (n - 1))
        delay *= 1 + self.jitter * (2 * rng.random() - 1)
        self.until[peer] = self.failed_until[peer] = now + delay
        return delay

    def busy(self, peer: str, now: float) -> None:
        self.until[peer] = max(self.until.get(peer, 0.0), now + self.busy_cooldown_s)

    def succeeded(self, peer: str) -> None:
        self.failures.pop(peer, None)
        self.until.pop(peer, None)
        self.failed_until.pop(peer, None)

    def blocked(self, peer: str, now: float) -> bool:
        return self.until.get(peer, 0.0) > now

    def backing_off(self, peer: str, now: float) -> bool:
        """In a failure's backoff (a BUSY's cooldown does not count: that peer is engaged, not failing)."""
        return self.failed_until.get(peer, 0.0) > now

    def forget_absent(self, present: Iterable[str]) -> None:
        """Drop records of peers that left the listing, so the table does not grow with churn."""
        keep = set(present)
        for table in (self.failures, self.until, self.failed_until):
            for p in [p for p in table if p not in keep]:
                del table[p]


def candidate_weights(bandwidth_bps: Mapping[str, float], *, weighted: bool) -> dict[str, float]:
    """Selection weight per candidate: 1.0 each (uniform), or its measured bandwidth. A peer that has not measured
    one yet (0) gets the median of the known ones, so newcomers are neither favoured nor starved."""
    if not weighted:
        return {p: 1.0 for p in bandwidth_bps}
    known = [b for b in bandwidth_bps.values() if b > 0]
    prior = statistics.median(known) if known else 1.0
    return {p: (b if b > 0 else prior) for p, b in bandwidth_bps.items()}


def pick_partner(ready: Mapping[str, float], backoff: Backoff, now: float, rng: random.Random, *,
                 weighted: bool, avoid: Iterable[str] = (), trust: Mapping[str, float] | None = None) -> str | None:
    """One partner among `ready` (peer id -> measured bandwidth, peers currently in state exchanging), skipping
    those in backoff and those in `avoid`; None when nobody is available right now. `trust` (peer -> score in
    (0, 1], protocol/guard.py; absent: 1) multiplies the selection weight, so a peer whose mixes were clipped or
    rejected is picked less often until its trust recovers."""
    skip = set(avoid)
    avail = {p: b for p, b in ready.items() if p not in skip and not backoff.blocked(p, now)}
    weights = candidate_weights(avail, weighted=weighted)
    if trust is not None:
        weights = {p: w * trust.get(p, 1.0) for p, w in weights.items()}
    return choose_partner(weights, rng)


def slower_peers(own_bps: float, pair_bps: Mapping[str, float], elapsed_s: float, window_s: float, *,
                 ratio: float) -> set[str]:
    """Peers to pass over (and answer busy to) for the first half of the partner search because our last exchange
    with them ran over `ratio` times slower than our link (`own_bps`: our best recent exchange rate). Empty when
    `ratio` is 0, in the second half, or for a peer we never exchanged with (rate 0).

    Why: an exchange runs at the slower link's pace, so a fast peer that pairs with a slow one spends the slow
    link's time (measured: 13 s instead of 1.3 s on the hetero bench). A like partner that becomes ready within half
    the search is worth waiting for; after that anyone is. That alone does not keep the link classes mixing: two
    fast peers that pair finish together and find each other at once, every round, so the caller also leaves a
    share of its searches open to all (swarm.slower_link_open_share). Only the faster side declines: to a slow peer
    every partner is as good as another. The judgement rests on our own exchanges, not on what a peer says of
    itself: a fast peer that happened to meet only slow partners has measured only slow rates, and would be passed
    over for good if others believed its own estimate (seen on the hetero bench with published estimates).
    """
    if ratio <= 0 or own_bps <= 0 or elapsed_s >= window_s / 2:
        return set()
    return {p for p, b in pair_bps.items() if 0 < b * ratio < own_bps}


def peers_to_explore(own_bps: float, pair_bps: Mapping[str, float], elapsed_s: float, window_s: float, *,
                     ratio: float) -> set[str]:
    """Peers to try first, for the first half of the partner search, while we cannot yet tell link classes apart:
    those among `pair_bps` (peer -> rate of our last exchange with it, 0 if none) we never exchanged with, as long
    as no rate we measured is over `ratio` times slower than our best (`own_bps`). Empty when `ratio` is 0, in the
    second half, or once a slower class is in sight (then slower_peers does the choosing).

    Why: slower_peers needs a like and an unlike exchange to compare, and a fast peer that keeps meeting slow ones
    never gets the like one: every rate it knows looks alike, its own best included. Measured in the e2e setting
    (2 fast peers and 1 slow, 60 s): in 2 of 8 runs the slow peer, which calls all the time, kept one fast peer
    busy while the other waited for it; the fast peers never met, and the rule never passed anyone over. The same
    with 2 fast and 2 slow (1 of 5 runs: every pair fast-slow, in lockstep). Trying an unmeasured peer first is how
    the classes get told apart; a slow peer, to which every rate looks alike, simply keeps meeting new partners.
    """
    if ratio <= 0 or elapsed_s >= window_s / 2 or slower_peers(own_bps, pair_bps, elapsed_s, window_s, ratio=ratio):
        return set()
    return {p for p, b in pair_bps.items() if b <= 0}


def peers_to_avoid(recent: Iterable[str], live: Iterable[str], elapsed_s: float, deadline_s: float,
                   soon: Iterable[str] | None = None) -> set[str]:
    """Recent partners to pass over for the first half of the partner search (`recent`: oldest first; `live`: the
    peers we could ask now, i.e. listed and not in backoff; `soon`: those of them ready now or expected ready
    within the first half, None: all of `live`).

    Why: two peers that just exchanged start their next round together and become ready together, so a plain
    "random among the ready" choice pairs them again and again; the swarm splits into fixed pairs that never mix
    (measured: consensus across pairs grew past 1.0 within a minute). Remembering one partner is not enough with
    equal speeds: the peers that finish together form a group that is ready while the others compute, and a peer
    alternates between two of its group. On the simulator's exact clock (8 workers, H = 20, tests/unit/
    test_sim_live.py) the swarm split into two groups of four that never met again; with three partners
    remembered and a wait only for peers due in the first half, every one of 4 seeds met all 28 pairs and stayed
    one component (docs/sim-results.md). The newest recent partners are passed over only while someone else we
    would take is due before the first half ends (waiting for a peer that cannot come in time only costs time),
    at most all of `live` but one (in a small swarm the oldest of them is fair game again), and never in the second
    half, so nobody is left without a partner. A streak (every remembered partner the same peer) is passed over in
    the first half even when nobody else is due: otherwise two pairs out of phase stay pairs for good.
    """
    live, recent = set(live), list(recent)
    if elapsed_s >= deadline_s / 2 or len(live) < 2:
        return set()
    newest = [p for p in dict.fromkeys(reversed(recent)) if p in live][:len(live) - 1]
    avoid = set(newest)
    others = (live if soon is None else set(soon) & live) - avoid
    if others:
        return avoid
    if len(recent) >= 2 and len(set(recent)) == 1 and recent[0] in live:
        # every remembered partner is the same peer: a pair that finishes together, locked in while the others
        # run out of phase (never due in our first half). Pass it over for the first half anyway, for whoever
        # comes by then. Measured in test_untrusted's 4-peer clean swarms: h0-h1 and h2-h3 paired in rounds 5-12,
        # drifted 0.57 apart and rejected each other in round 13.
        return {recent[0]}
    return set()
