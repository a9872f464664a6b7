"""GASLoC's round communication in the live swarm: randomized pairwise exchange, never a wait for the swarm.

One round, as this peer sees it:
  1. offer our outgoing tensors to the Exchanger and announce state "exchanging" (others now may call us);
  2. until swarm.partner_deadline_s passes: take an incoming exchange if one finished; else pick a random partner
     among the live peers in state "exchanging" (uniform, or weighted by measured bandwidth), skipping those in
     backoff (and, in the first half of the search, our most recent partner and, with swarm.slower_link_ratio,
     peers on much slower links, whom we also answer BUSY then, except in a random share of searches; until we
     have told link classes apart, that rule tries peers we never exchanged with first), and call it.
     BUSY -> a short cooldown for that partner and a random pause (two peers that called each other at the same
     moment both got BUSY); timeout/failed/rejected -> exponential backoff;
  3. withdraw the offer. An incoming exchange that completed meanwhile is still used: the partner mixed with us,
     so we mix with it too (that keeps the pair's mean).
No partner by the deadline, or no other live peer at all, is a solo round. An exchange already running when the
deadline (or a shutdown request) comes is allowed to finish within its own deadline (exchange.exchange_timeout_s).

With outer.overlap the same search runs in the background (`begin`) while the next round's inner steps run, and
ends at the later of partner_deadline_s and the end of those steps (`settle`): a partner that becomes ready any
time during our next round can still pair with us, and we never give up sooner than a plain round would (measured:
ending at the inner steps alone left fast peers of the hetero bench solo in most rounds, and with outer momentum
0.9 they diverged).

The listing of who is ready comes from the background lister (peer/network.py): the search never waits on the DHT.
"""
from __future__ import annotations

import collections
import concurrent.futures
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from hivemind.p2p import PeerID

from gasloc.peer.exchange import ExchangeResult, Exchanger, Outcome
from gasloc.peer.partners import Backoff, peers_to_avoid, peers_to_explore, pick_partner, slower_peers
from gasloc.peer.round_report import RoundExchange

log = logging.getLogger(__name__)

LISTING_MAX_AGE_S = 0.3  # while looking for a partner, ask for a listing at most this stale (in the background)


@dataclass
class Background:
    """Overlap: a partner search and exchange running on the event loop while the training thread trains."""
    cut: threading.Event           # set: stop searching (an exchange in flight still finishes)
    future: concurrent.futures.Future
    round: int

    def done(self) -> bool:
        """The search is over (an exchange completed, or it gave up): settling it will not wait."""
        return self.future.done()


class GossipAveraging:
    def __init__(self, cfg, net, *, stopping, set_state: Callable[[str], None],
                 own_link: Callable[[], float] = lambda: 0.0):
        self.cfg, self.net, self.stopping, self.set_state = cfg, net, stopping, set_state
        self.own_link = own_link     # our link's estimated bytes/s (0: not measured yet)
        self._search: tuple[float, float] | None = None   # (start, window) of a search passing over slower links
        self._passed: set[str] = set()                     # ready peers that search passed over (slower links)
        sw = cfg.swarm
        self.backoff = Backoff(sw.min_backoff_s, sw.max_backoff_s, sw.busy_cooldown_s)
        self.rng = random.Random()  # partner choice must differ between peers: seeded from the OS
        self.recent: collections.deque[str] = collections.deque(maxlen=sw.avoid_recent_partners)
        self.exchanger: Exchanger | None = None

    def start(self, specs: list[tuple[tuple[int, ...], torch.dtype]], fingerprint: str) -> None:
        self.exchanger = Exchanger(self.cfg.exchange, self.net.p2p, specs=specs, fingerprint=fingerprint,
                                   is_member=self.net.is_member, namespace=self.cfg.swarm.run_id,
                                   declines=self._declines)
        self.net.aio.run(self.exchanger.start(), self.cfg.network.startup_timeout_s)

    def average(self, sent: list[torch.Tensor], round: int, live_count: Callable[[], int]) -> RoundExchange:
        """Blocks the training thread for at most partner_deadline_s plus one exchange's deadline."""
        return self._result(self.net.aio.submit(self._average(sent, round)), round)

    def begin(self, sent: list[torch.Tensor], round: int, window_s: float) -> Background:
        """Overlap: start this round's partner search and exchange in the background; `window_s` is how long the
        next inner phase is expected to take (the search's horizon). Pass the result to `settle`."""
        cut = threading.Event()
        return Background(cut, self.net.aio.submit(self._average(sent, round, cut=cut, window_s=window_s)), round)

    def settle(self, pending: Background) -> RoundExchange:
        """Overlap: end the background search once partner_deadline_s since `begin` has passed (an exchange in
        flight finishes within its deadline) and return what it got; at once when `pending.done()`."""
        pending.cut.set()
        return self._result(pending.future, pending.round)

    def _link_view(self, peers, now: float) -> tuple[set[str], set[str]]:
        """For a search that passes over slower links, right now: (the peers among `peers` to pass over for being on
        much slower links, the ones to try first because we never exchanged with them and cannot yet tell link
        classes apart). Judged by the rate of our own last exchange with each; both empty in an open search."""
        if self._search is None:
            return set(), set()
        start, window = self._search
        rates = {p: self.exchanger.rate(p) for p in peers}
        args = (self.own_link(), rates, now - start, window)
        ratio = self.cfg.swarm.slower_link_ratio
        return slower_peers(*args, ratio=ratio), peers_to_explore(*args, ratio=ratio)

    def _declines(self, peer_id: PeerID) -> str | None:
        """The exchanger asks before accepting a caller: why to answer it busy, or None to accept."""
        if self._link_view([str(peer_id)], time.monotonic())[0]:
            self._passed.add(str(peer_id))
            return "waiting for a partner on a link like ours"
        return None

    def _result(self, fut: concurrent.futures.Future, round: int) -> RoundExchange:
        limit = self.cfg.swarm.partner_deadline_s + self.cfg.exchange.exchange_timeout_s + 10
        try:
            return self.net.aio.wait(fut, limit)
        except TimeoutError:  # every await inside has its own deadline; reaching this one is a bug, made visible
            log.error("round=%d partner search overran its %.0f s limit; solo round", round, limit)
            return RoundExchange(outcome="failed", detail="partner search overran its limit")

    async def _average(self, sent: list[torch.Tensor], round: int, cut: threading.Event | None = None,
                       window_s: float | None = None) -> RoundExchange:
        ex, sw = self.exchanger, self.cfg.swarm
        t0 = time.monotonic()
        # overlap: search until the cut (the end of our next inner phase), and at least partner_deadline_s;
        # avoid recent partners for the first half of that
        deadline = t0 + sw.partner_deadline_s
        window_s = sw.partner_deadline_s if cut is None else max(window_s, sw.partner_deadline_s)
        report = RoundExchange()
        # a share of searches is open to every link (see SwarmConfig.slower_link_open_share)
        picky = sw.slower_link_ratio > 0 and self.rng.random() >= sw.slower_link_open_share
        self._search, self._passed = ((t0, window_s) if picky else None), set()
        ex.offer(sent, round)
        self.set_state("exchanging")  # offer first: whoever sees the announcement may call us at once
        try:
            while True:
                if self._take(await ex.wait_incoming(0), report):
                    break
                now = time.monotonic()
                if (now >= deadline and (cut is None or cut.is_set())) or self.stopping.is_set():
                    if (ex.engaged or "").startswith("responder"):
                        # a partner is mid-exchange with us: let it finish (bounded by its own deadline) rather
                        # than cut it off - the bytes are already moving and both sides would lose the round
                        self._take(await ex.wait_incoming(self.cfg.exchange.exchange_timeout_s + 1), report)
                    break
                if not self.net.live:
                    break  # alone in the run: nobody can become ready, so waiting would only slow us down
                self.net.request_listing(max_age_s=LISTING_MAX_AGE_S)
                ready = self.net.ready_peers()
                self.backoff.forget_absent(self.net.live)
                others = [p for p in self.net.live if not self.backoff.blocked(p, now)]
                slower, explore = self._link_view(others, now)
                self._passed |= slower & ready.keys()
                # a recent partner is passed over only while someone else we would take may become ready
                avoid = peers_to_avoid(self.recent, set(others) - slower, now - t0, window_s) | slower
                if explore:  # only unmeasured peers until one of them is ready or the first half is over
                    avoid |= set(others) - explore
                partner = pick_partner({p: r.bandwidth_bps for p, r in ready.items()}, self.backoff, now, self.rng,
                                       weighted=sw.bandwidth_weighting, avoid=avoid)
                if partner is None:
                    left = deadline - time.monotonic()
                    # overlap past the deadline: search on, at the retry pace, until our inner steps end
                    pause = sw.retry_interval_s if cut is not None and left <= 0 else min(sw.retry_interval_s,
                                                                                           max(left, 0.0))
                    if self._take(await ex.wait_incoming(pause), report):
                        break
                    continue
                res = await ex.exchange(PeerID.from_base58(partner))
                if self._take(res, report):
                    break
                if res.outcome is Outcome.busy:
                    if not res.detail.startswith("local"):
                        self.backoff.busy(partner, time.monotonic())
                    pause = self.rng.uniform(0, sw.retry_interval_s)
                    if self._take(await ex.wait_incoming(pause), report):
                        break
                else:
                    delay = self.backoff.failed(partner, time.monotonic(), self.rng)
                    log.info("round=%d partner=%s outcome=%s backoff_s=%.1f detail=%s", round, partner,
                             res.outcome.value, delay, res.detail)
        finally:
            self._search = None
            for res in await ex.withdraw():
                if res.ok and not report.ok:
                    self._take(res, report)
            if cut is not None:
                self.set_state("training")  # the search is over; our inner steps are running
        report.wait_s = time.monotonic() - t0 - report.transfer_s
        report.passed_over = len(self._passed)
        return report

    def _take(self, res: ExchangeResult | None, report: RoundExchange) -> bool:
        """Fold one exchange result into the round's report; True when it succeeded (the round has its partner)."""
        if res is None:
            return False
        report.attempts += 1
        report.partner, report.outcome, report.detail = res.partner, res.outcome.value, res.detail
        report.bytes_sent += res.bytes_sent
        report.bytes_received += res.bytes_received
        report.exchange_s = res.seconds
        if not res.ok:
            return False
        report.received, report.kind, report.group_size = res.tensors, "pair", 2
        self.backoff.succeeded(res.partner)
        if self.recent.maxlen:
            self.recent.append(res.partner)
        return True

    def close(self) -> None:
        if self.exchanger is not None:
            self.net.aio.run(self.exchanger.stop(), 10)
