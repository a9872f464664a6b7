"""The partner search of one GASLoC round, as a pure policy: what we know in, the next action out.

The live peer (peer/swarm/gossip.py) carries the actions out on its event loop; tests drive the same object on a
virtual clock. Nothing here reads a clock, sleeps or does I/O: every method takes `now`.

One search, as the driver runs it:
    search = policy.begin(now, window_s)        # we offered our tensors and announced "exchanging"
    loop:
        an incoming exchange finished ok?  -> policy.succeeded(partner); done
        action = search.next(sight, now)
        Finish(let_finish_s)   -> stop; with let_finish_s > 0 first wait that long for the responder exchange
                                  already in flight with us (bytes are moving; cutting it would cost both sides)
        Wait(s)                -> wait up to s for an incoming exchange, then ask again
        Call(peer)             -> exchange with peer; ok -> policy.succeeded(peer), done;
                                  else pause = search.called(peer, outcome, local, now); wait up to pause
    policy.end()

Rules (their reasons are in protocol/partners.py):
- the search ends at `partner_deadline_s`; an overlapped search (outer.overlap) also not before the cut, the end
  of our next inner phase, and its window is the longer of the two;
- nobody else live: finish at once (nobody can become ready);
- adaptive deadline (SearchRules.adaptive): a plain search ends at median + k*MAD of how long recent searches
  waited for their partner (within [partner_deadline_min_s, partner_deadline_s]; a search that hit its deadline
  while someone was coming counts as a wait of that deadline, so the estimate grows back when it was too short),
  and at once when nobody is coming: no peer is ready and no training peer is expected ready before our deadline
  (the driver's estimate: when it entered its inner phase plus how long that phase takes it; rounds are not
  compared - peers' round counts drift apart and say nothing about when they are ready);
- never call a peer in `uncallable` (behind NAT and attached to no forwarder: it calls; protocol/reach.py), but
  keep waiting for its call;
- pick among ready peers not in backoff, passing over our recent partners (while someone else is due within the
  first half of the window), and (with slower_link_ratio, in a "picky" search) peers on much slower links, for the
  first half of the window (while it cannot tell link classes apart yet, a picky search calls only peers it never
  exchanged with, those in a BUSY cooldown included, and answers the others BUSY); the other searches
  (slower_link_open_share, every 1/share-th search) serve those slower peers first: while one is ready in the first
  half, it is the one called, and other callers are answered BUSY;
- BUSY from the partner: a short cooldown for it and a random pause for us (two peers that called each other at
  once both got BUSY); BUSY from our own side (our offer was taken meanwhile) costs the partner nothing;
  a timeout, failure or rejection: exponential backoff for that partner;
- trust (protocol/guard.py, when the policy has a TrustBook): a peer whose mixes we clipped or rejected is picked
  with probability scaled by its trust, and below guard.busy_below it is neither called nor accepted (BUSY) while
  someone else in sight is not distrusted (the only partner is never turned away: the guard still judges it).
"""
from __future__ import annotations

import collections
import math
import random
import statistics
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from gasloc.protocol.guard import TrustBook, Verdict
from gasloc.protocol.partners import Backoff, peers_to_avoid, peers_to_explore, pick_partner, slower_peers


class Call(NamedTuple):
    peer: str


class Wait(NamedTuple):
    seconds: float


class Finish(NamedTuple):
    reason: str
    let_finish_s: float = 0.0


Action = Call | Wait | Finish


@dataclass(frozen=True)
class SearchRules:
    """The knobs of the search (from SwarmConfig and ExchangeConfig)."""
    partner_deadline_s: float = 10.0
    retry_interval_s: float = 0.25
    exchange_timeout_s: float = 30.0
    bandwidth_weighting: bool = False
    slower_link_ratio: float = 0.0
    slower_link_open_share: float = 0.25
    adaptive: bool = False                 # the adaptive deadline above; False: every search may use the full one
    adaptive_k: float = 3.0                # deadline = median + adaptive_k * MAD of recent waits
    partner_deadline_min_s: float = 1.0    # the adaptive deadline's floor (listings are up to ~1 s old)
    adaptive_samples: int = 16             # recent waits remembered
    adaptive_min_samples: int = 3          # fewer than this: the fixed deadline


@dataclass(frozen=True)
class Sight:
    """What the peer knows at one instant.

    live: compatible peers in the listing; ready: those in state "exchanging" -> the bandwidth that weights them;
    rates: bytes/s of our last exchange with a peer (0 or absent: never); own_link: our link's estimate;
    cut: an overlapped search may end (our next inner phase is over; plain rounds: always True);
    engaged_as_responder: a partner is mid-exchange with us right now;
    training: live peers in state "training" -> when (on the `now` clock) they are expected to be ready, estimated
    by the driver from what they announce (a claim: at worst it makes us wait up to the deadline for a peer that is
    not coming, or go solo a round early); a peer whose time is unknown counts as expected now."""
    live: Collection[str]
    ready: Mapping[str, float]
    rates: Mapping[str, float] = field(default_factory=dict)
    own_link: float = 0.0
    cut: bool = True
    stopping: bool = False
    engaged_as_responder: bool = False
    training: Mapping[str, float] = field(default_factory=dict)
    # live peers -> when (on the `now` clock) they entered the state they announce now; absent: unknown. Lifts a
    # "no free offer" once the peer announced a new state after it (Search.gone)
    entered: Mapping[str, float] = field(default_factory=dict)

    def coming(self, by: float) -> set[str]:
        """Peers that may still become ready for the round we are in: ready now, or training and expected ready
        by `by` (our search's deadline)."""
        return set(self.ready) | {q for q, eta in self.training.items() if eta <= by}
    uncallable: Collection[str] = ()   # live peers nobody can call: they call us (protocol/reach.py route)


class PartnerPolicy:
    """What a peer remembers across rounds (backoff, recent partners, its RNG) and the search of the current one."""

    def __init__(self, rules: SearchRules, backoff: Backoff, *, avoid_recent: int, rng: random.Random,
                 trust: TrustBook | None = None):
        self.rules, self.backoff, self.rng, self.trust = rules, backoff, rng, trust
        self.recent: collections.deque[str] = collections.deque(maxlen=avoid_recent)
        self.waits: collections.deque[float] = collections.deque(maxlen=rules.adaptive_samples)
        self.search: Search | None = None
        # open-search credit (slower_link_open_share), from a random phase at the first search so that peers do
        # not open in step (drawn then: with the rule off the RNG's draws are the same as without it)
        self._open_credit: float | None = None

    def deadline_s(self) -> float:
        """How long a plain search may look for a partner: partner_deadline_s, or with rules.adaptive and enough
        history, median + k*MAD of the recent waits, clamped to [partner_deadline_min_s, partner_deadline_s].
        Median and MAD rather than mean and deviation: one partner that arrived after 9 s should not set the
        deadline of every later round."""
        r = self.rules
        if not r.adaptive or len(self.waits) < r.adaptive_min_samples:
            return r.partner_deadline_s
        med = statistics.median(self.waits)
        mad = statistics.median(abs(w - med) for w in self.waits)
        return min(r.partner_deadline_s, max(r.partner_deadline_min_s, med + r.adaptive_k * mad))

    def begin(self, now: float, window_s: float | None = None) -> Search:
        """A new round's search. `window_s`: an overlapped search's horizon (how long our next inner phase is
        expected to take); None for a plain round, which searches for partner_deadline_s."""
        r = self.rules
        # a share of searches is open to every link (see SwarmConfig.slower_link_open_share), spread evenly: the
        # share is added up and a search opens each time the sum passes 1. Drawn at random per search, a fast peer
        # of the e2e swarm (2 fast, 1 slow; 6 searches in 30 s) opened 1 of its 6 in one run and 0 of 6 in another,
        # and the slow peer went without a partner for those 30 s
        picky = r.slower_link_ratio > 0
        if picky:
            if self._open_credit is None:
                self._open_credit = self.rng.random()
            self._open_credit += r.slower_link_open_share
            picky = self._open_credit < 1
            if not picky:
                self._open_credit -= 1
        self.search = Search(self, now, window_s, picky)
        return self.search

    def end(self) -> None:
        self.search = None

    def succeeded(self, peer: str, waited_s: float | None = None) -> None:
        """An exchange with `peer` succeeded; `waited_s`: how long this round's search looked before it began (a
        sample for the adaptive deadline; None for an overlapped search, whose wait is hidden by our inner steps)."""
        self.backoff.succeeded(peer)
        if self.recent.maxlen:
            self.recent.append(peer)
        if waited_s is not None:
            self.waits.append(max(0.0, waited_s))

    def judged(self, peer: str, verdict: Verdict, now: float) -> float:
        """The guard's verdict on a partner's tensors (clip or reject lowers its trust); returns its trust now."""
        if self.trust is None:
            return 1.0
        self.trust.forget_recovered(now)
        return self.trust.penalize(peer, verdict, now)

    def distrusted(self, peer: str, now: float, live: Collection[str] | None = None) -> bool:
        """Whether to turn `peer` away (not call it, answer it BUSY): its trust is below guard.busy_below and, when
        `live` (the peers in sight) is given, someone else in sight is not. Distrust steers the choice among
        partners; it never turns the only one away: in a 2-peer swarm that made a solo round of every round until
        the trust recovered (~30 s), the two drifted apart, and the guard rejected each other by distance from
        then on (the compose swarm of the docker test: 4 ok exchanges in 10 rounds). Its tensors still pass the
        guard, so a hostile only partner is clipped or rejected all the same."""
        return peer in self.turned_away({peer}, now, live)

    def lowered_trust(self, now: float) -> dict[str, float]:
        """peer -> trust of the peers whose trust our guard lowered (protocol/donors.py pick_donors asks them last)."""
        return {} if self.trust is None else self.trust.lowered(now)

    def turned_away(self, peers: Collection[str], now: float, live: Collection[str] | None = None) -> set[str]:
        """Those of `peers` that `distrusted` turns away, with one pass over `live` for all of them (the search
        asks for every ready peer at each step)."""
        if self.trust is None:
            return set()
        low = {q for q in peers if self.trust.distrusted(q, now)}
        if low and live is not None and all(self.trust.distrusted(q, now) for q in live):
            return set()  # nobody in sight to turn to instead
        return low

    def declines(self, peer: str, rate: float, own_link: float, now: float) -> bool:
        """A caller arrives: answer it BUSY? In the first half of a picky search, because its link is much slower
        than ours (remembered as passed over); in the first half of a serving one, because it is not one of the
        slower peers that were ready when we last looked (we are calling one of them)."""
        s = self.search
        if s is None:
            return False
        first_half = now - s.start < s.window_s / 2
        if not s.picky:
            return bool(s.serving) and peer not in s.serving and first_half
        if s.exploring and peer not in s.exploring and first_half:
            # exploring, we call only peers we never measured; accepting a measured caller would undo that: the
            # slow peer of the e2e swarm (2 fast, 1 slow), which calls everyone, took each fast peer in turn for
            # its 11-s exchanges, the fast peers never met, and nobody was ever passed over (CI, 4 rounds of 60 s)
            return True
        if not s.slower({peer: rate}, own_link, now):
            return False
        s.passed.add(peer)
        return True


@dataclass
class Search:
    policy: PartnerPolicy
    start: float
    window_s: float | None
    picky: bool
    passed: set[str] = field(default_factory=set)  # ready peers passed over for being on much slower links
    # answered that their offer is used or withdrawn -> when: done with the round they were in (paired, solo, or
    # still computing), whatever a stale listing shows, until they announce a new state after that answer
    gone_at: dict[str, float] = field(default_factory=dict)
    serving: set[str] = field(default_factory=set)  # a search that is not picky: the ready peers on much slower
    #                                                 links, served first (as of our last look)
    exploring: set[str] = field(default_factory=set)  # a picky search that cannot tell link classes apart yet: the
    #                                                   unmeasured peers it calls first (as of our last look)

    def __post_init__(self) -> None:
        r = self.policy.rules
        self.overlapped = self.window_s is not None
        self.deadline = self.start + self.policy.deadline_s()
        # overlap: search until the cut and at least partner_deadline_s; recent partners are avoided for the
        # first half of that longer window
        self.window_s = r.partner_deadline_s if self.window_s is None else max(self.window_s, r.partner_deadline_s)

    def slower(self, rates: Mapping[str, float], own_link: float, now: float) -> set[str]:
        """The peers a picky search passes over now (empty for the others)."""
        return self.much_slower(rates, own_link, now) if self.picky else set()

    def much_slower(self, rates: Mapping[str, float], own_link: float, now: float) -> set[str]:
        return slower_peers(own_link, rates, now - self.start, self.window_s, ratio=self.policy.rules.slower_link_ratio)

    def gone(self, sight: Sight) -> set[str]:
        """The peers whose "no free offer" still holds: none announced a state it entered after that answer. A
        fast peer's rounds are shorter than a slow peer's search (e2e 3-peer swarm: 3-4 s against 10 s): marked
        for the whole search, the slow peer gave up on both fast peers while they were computing and went solo
        while they came back and paired with each other."""
        return {q for q, t in self.gone_at.items() if sight.entered.get(q, -math.inf) <= t}

    def next(self, sight: Sight, now: float) -> Action:
        p, r = self.policy, self.policy.rules
        gone = self.gone(sight)
        coming = sight.coming(self.deadline) - gone
        if (now >= self.deadline and (not self.overlapped or sight.cut)) or sight.stopping:
            if not sight.stopping and r.adaptive and not self.overlapped and coming:
                # censored sample: someone was coming and did not make it; the estimate must be able to grow back
                p.waits.append(self.deadline - self.start)
            return Finish("deadline" if not sight.stopping else "stopping",
                          r.exchange_timeout_s + 1 if sight.engaged_as_responder else 0.0)
        if not sight.live:
            return Finish("alone")
        # an overlapped search costs nothing while our inner steps run, so it only gives up at its cut
        if (r.adaptive and not coming and not sight.engaged_as_responder
                and (not self.overlapped or sight.cut)):
            return Finish("nobody coming")
        p.backoff.forget_absent(sight.live)
        # a peer we do not call still counts as live (it may call us): we wait for it, we never dial it
        uncallable = set(sight.uncallable)
        others = [q for q in sight.live if not p.backoff.blocked(q, now) and q not in uncallable]
        rates = {q: sight.rates.get(q, 0.0) for q in others}
        slower = self.slower(rates, sight.own_link, now)
        # what to explore is judged over every callable peer not in a failure's backoff, those in a BUSY cooldown
        # included: such a peer is engaged, not gone. Left out for its 0.5 s, the only unmeasured peer emptied the
        # set, and in that half second the search called the measured slow peer or accepted its call (which comes
        # just then: it ends its exchange with that very peer at the same instant). That fits the e2e flake of 2
        # fast peers and 1 slow in which the fast ones only ever paired with the slow one (1 CI run in 6)
        explorable = {q: sight.rates.get(q, 0.0) for q in sight.live
                      if q not in uncallable and not p.backoff.backing_off(q, now)}
        explore = self.exploring = (peers_to_explore(sight.own_link, explorable, now - self.start, self.window_s,
                                                     ratio=r.slower_link_ratio) if self.picky else set())
        self.passed |= slower & sight.ready.keys()
        # a recent partner is passed over only while someone else we would take is due in the first half (a live
        # peer in neither state, e.g. joining, has no estimate: it may be, as Sight.training's unknowns)
        half = self.start + self.window_s / 2
        soon = {q for q in sight.live if q not in sight.training or sight.training[q] <= half}
        avoid = peers_to_avoid(p.recent, set(others) - slower, now - self.start, self.window_s, soon=soon)
        avoid |= slower | gone
        if explore:  # only unmeasured peers until one of them is ready or the first half is over
            avoid |= set(others) - explore
        trust, turned = None, set()
        if p.trust is not None:  # a repeat offender is not called until its trust recovers, and picked less often
            trust = p.trust.weights(sight.ready, now)
            turned = p.turned_away(trust.keys(), now, sight.live)
        if not self.picky and r.slower_link_ratio > 0:
            # a serving search (slower_link_open_share): the slow peers the picky ones pass over are called first.
            # Merely open, it served nobody: the fast peers of the e2e swarm (2 fast, 1 slow) become ready
            # together and paired at once, and the slow one got BUSY in 4 of its 6 rounds (fast-slow 1.5 of 15).
            # Not one we turn away: serving a distrusted peer called nobody and declined everyone else for half
            # the window (both fast peers waited 5 s a round there).
            self.serving = (self.much_slower(rates, sight.own_link, now) & sight.ready.keys()) - gone - turned
            if self.serving:  # even one that was a recent partner: serving them is what this search is for
                avoid = (avoid - self.serving) | (set(others) - self.serving)
        avoid |= turned
        partner = pick_partner(sight.ready, p.backoff, now, p.rng, weighted=r.bandwidth_weighting,
                               avoid=avoid | uncallable, trust=trust)
        if partner is not None:
            return Call(partner)
        left = self.deadline - now
        # overlap past the deadline: search on, at the retry pace, until our inner steps end
        return Wait(r.retry_interval_s if self.overlapped and left <= 0 else min(r.retry_interval_s, max(left, 0.0)))

    def called(self, peer: str, outcome: str, now: float, *, local: bool = False, gone: bool = False) -> float:
        """A call of ours did not succeed: record it; returns how long to wait (for an incoming exchange) before the
        next step. `local`: the BUSY came from our own side (our offer was taken meanwhile); `gone`: the partner's
        BUSY said it has no free offer (it paired, gave up or is not searching: not coming, whatever the listing
        says, until it announces a new state; Search.gone)."""
        p = self.policy
        if gone:
            self.gone_at[peer] = now
        if outcome == "busy":
            if not local:
                p.backoff.busy(peer, now)
            return p.rng.uniform(0, p.rules.retry_interval_s)
        p.backoff.failed(peer, now, p.rng)
        return 0.0

    def backoff_of(self, peer: str, now: float) -> float:
        """Seconds until `peer` may be called again (for the log line after a failure)."""
        return max(0.0, self.policy.backoff.until.get(peer, now) - now)
