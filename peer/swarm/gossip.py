"""GASLoC's round communication in the live swarm: randomized pairwise exchange, never a wait for the swarm.

One round, as this peer sees it:
  1. offer our outgoing tensors to the Exchanger and announce state "exchanging" (others now may call us);
  2. carry out what the partner-search policy (protocol/search.py, pure and unit-tested on a virtual clock)
     says next - call a peer, wait for a caller, or finish - until an exchange succeeds in either direction;
  3. withdraw the offer. An incoming exchange that completed meanwhile is still used: the partner mixed with us,
     so we mix with it too (that keeps the pair's mean).
No partner by the deadline, or no other live peer at all, is a solo round. An exchange already running when the
deadline (or a shutdown request) comes is allowed to finish within its own deadline (exchange.exchange_timeout_s).

With outer.overlap the same search runs in the background (`begin`) while the next round's inner steps run, and
ends at the later of partner_deadline_s and the end of those steps (`settle`): a partner that becomes ready any
time during our next round can still pair with us, and we never give up sooner than a plain round would (measured:
ending at the inner steps alone left fast peers of the hetero bench solo in most rounds, and with outer momentum
0.9 they diverged).

The listing of who is ready comes from the background lister (peer/swarm/network.py) and from peer exchange (the
hints in every exchange header, protocol/buckets.py): the search never waits on the DHT.
"""
from __future__ import annotations

import concurrent.futures
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from hivemind.p2p import PeerID

from gasloc.peer.swarm.round_report import RoundExchange
from gasloc.peer.transport.exchange import NO_FREE_OFFER, Exchanger, ExchangeResult, Outcome
from gasloc.protocol.guard import TrustBook
from gasloc.protocol.partners import Backoff, peers_to_avoid
from gasloc.protocol.search import Call, Finish, PartnerPolicy, SearchRules, Sight, Wait

log = logging.getLogger(__name__)


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
                 own_link: Callable[[], float] = lambda: 0.0, keep_buffers: bool = True):
        self.cfg, self.net, self.stopping, self.set_state = cfg, net, stopping, set_state
        # False (a CPU peer): the exchange's buffers are dropped after each search and the received tensors are not
        # recycled, so between exchanges the memory (2.5 parameter copies with int8) serves the inner phase
        self.keep_buffers = keep_buffers
        self.own_link = own_link     # our link's estimated bytes/s (0: not measured yet)
        sw = cfg.swarm
        rules = SearchRules(partner_deadline_s=sw.partner_deadline_s, retry_interval_s=sw.retry_interval_s,
                            exchange_timeout_s=cfg.exchange.exchange_timeout_s,
                            bandwidth_weighting=sw.bandwidth_weighting, slower_link_ratio=sw.slower_link_ratio,
                            slower_link_open_share=sw.slower_link_open_share,
                            adaptive=sw.adaptive_deadline, adaptive_k=sw.adaptive_deadline_k,
                            partner_deadline_min_s=min(sw.partner_deadline_min_s, sw.partner_deadline_s))
        # partner choice must differ between peers: the RNG is seeded from the OS
        # trust (guard.enabled): the daemon reports its guard's verdicts (judged), the search and _declines read it
        trust = TrustBook(cfg.guard) if cfg.guard.enabled else None
        self.policy = PartnerPolicy(rules, Backoff(sw.min_backoff_s, sw.max_backoff_s, sw.busy_cooldown_s),
                                    avoid_recent=sw.avoid_recent_partners, rng=random.Random(), trust=trust)
        self.exchanger: Exchanger | None = None
        self._search_t0: float | None = None  # start of the plain search in progress (one at a time)

    def start(self, specs: list[tuple[tuple[int, ...], torch.dtype]], fingerprint: str) -> None:
        self.exchanger = Exchanger(self.cfg.exchange, self.net.p2p, specs=specs, fingerprint=fingerprint,
                                   is_member=self.net.confirm_member, namespace=self.cfg.swarm.run_id,
                                   declines=self._declines, swarm_key=self.net.swarm_key,
                                   hints_out=self.net.hints_for, hints_in=self.net.heard,
                                   admit=self.net.admit_caller, member_out=self.net.member_out,
                                   members_out=self.net.members_for, members_in=self.net.members_heard)
        self.net.aio.run(self.exchanger.start(), self.cfg.network.startup_timeout_s)

    def average(self, sent: list[torch.Tensor], round: int, live_count: Callable[[], int],
                receive_into: list[torch.Tensor] | None = None) -> RoundExchange:
        """Blocks the training thread for at most partner_deadline_s plus one exchange's deadline. `receive_into`:
        CPU tensors of the specs' shapes that the caller does not read until this returns (outer.idle_buffers),
        where the first exchange decodes the partner's tensors; the Staging lets go of them when the search ends."""
        return self._result(self.net.aio.submit(self._average(sent, round, receive_into=receive_into)), round)

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

    def recycle(self, ex: RoundExchange) -> None:
        """Hand an ok exchange's received tensors back to the Exchanger once they are mixed in, so the next exchange
        receives into them instead of fresh memory. The caller reads ex.received no more (it stays set: ex.ok and
        the round's metrics depend on it)."""
        if ex.ok and ex.kind == "pair" and self.keep_buffers:
            # on the loop: the Exchanger's spare buffers are the loop's (an exchange may be starting there)
            self.net.aio.loop.call_soon_threadsafe(self.exchanger.recycle, list(ex.received))

    def _declines(self, peer_id: PeerID) -> str | None:
        """The exchanger asks before accepting a caller: why to answer it busy, or None to accept."""
        return self._declines_peer(str(peer_id))

    def _declines_peer(self, peer: str) -> str | None:
        if self._recent_caller(peer):
            return "a recent partner: others first for the first half of our search (swarm.avoid_recent_partners)"
        if self.policy.distrusted(peer, time.monotonic(), self.net.in_sight()):
            return "distrusted: its recent mixes were clipped or rejected (guard.busy_below)"
        if self.policy.declines(peer, self.exchanger.rate(peer), self.own_link(), time.monotonic()):
            return "waiting for a partner on a link like ours"
        return None

    def _recent_caller(self, peer: str) -> bool:
        """Whether a caller is one of the recent partners our own search passes over now (protocol/partners.py
        peers_to_avoid, on the same inputs as Search.next): the responder is as fair as the caller. Without it a
        peer that calls at once every round (an always-ready Sybil, or a partner that finishes with us) took our
        free offer every round, whatever our own search would have chosen."""
        s = self.policy.search
        if s is None or not self.policy.recent:
            return False
        now = time.monotonic()
        live = {q for q in self.net.in_sight() if not self.policy.backoff.blocked(q, now)} | {peer}
        training, half = self.net.ready_at(now), s.start + s.window_s / 2
        soon = {q for q in live if q not in training or training[q] <= half}
        return peer in peers_to_avoid(self.policy.recent, live, now - s.start, s.window_s, soon=soon)

    def _result(self, fut: concurrent.futures.Future, round: int) -> RoundExchange:
        limit = self.cfg.swarm.partner_deadline_s + self.cfg.exchange.exchange_timeout_s + 10
        try:
            return self.net.aio.wait(fut, limit)
        except TimeoutError:  # every await inside has its own deadline; reaching this one is a bug, made visible
            log.error("round=%d partner search overran its %.0f s limit; solo round", round, limit)
            return RoundExchange(outcome="failed", detail="partner search overran its limit")

    def _sight(self, cut: threading.Event | None) -> Sight:
        in_sight = self.net.in_sight()    # the peers we hold a record of, and those that peer exchange told us of
        ex, now = self.exchanger, time.monotonic()
        # partner weights are our own measured rates with each peer: a record's bandwidth_bps is its owner's
        # claim (a Sybil announcing 1e30 would be picked whenever free), our measurement is a fact
        return Sight(live=in_sight, ready={p: ex.rate(p) for p in self.net.ready_peers()},
                     rates={p: ex.rate(p) for p in in_sight}, own_link=self.own_link(),
                     cut=cut is None or cut.is_set(), stopping=self.stopping.is_set(),
                     engaged_as_responder=(ex.engaged or "").startswith("responder"),
                     training=self.net.ready_at(now), entered=self.net.entered_at(now),
                     uncallable=self.net.uncallable())

    async def _average(self, sent: list[torch.Tensor], round: int, cut: threading.Event | None = None,
                       window_s: float | None = None, receive_into: list[torch.Tensor] | None = None
                       ) -> RoundExchange:
        """Carry out the partner search's actions until an exchange succeeds or the search finishes."""
        ex = self.exchanger
        t0 = time.monotonic()
        report = RoundExchange()
        # the adaptive deadline learns from plain searches only: an overlapped one's wait is hidden by inner steps
        self._search_t0 = t0 if cut is None else None
        search = self.policy.begin(t0, None if cut is None else window_s)
        self.net.search_begins()
        if receive_into is not None:
            ex.recycle(receive_into)  # the spare decoded tensors: the first exchange decodes into them
        ex.offer(sent, round)
        self.set_state("exchanging")  # offer first: whoever sees the announcement may call us at once
        try:
            while not self._take(await ex.wait_incoming(0), report):
                sight = self._sight(cut)
                if not sight.ready:
                    # nobody ready in sight: another bucket, in the background and with backoff (the search never
                    # waits on the DHT); with someone ready, its answer's hints are worth more than a listing
                    self.net.search_listing()
                action = search.next(sight, time.monotonic())
                if isinstance(action, Finish):
                    if action.let_finish_s:
                        # a partner is mid-exchange with us: let it finish (bounded by its own deadline) rather
                        # than cut it off - the bytes are already moving and both sides would lose the round
                        self._take(await ex.wait_incoming(action.let_finish_s), report)
                    break
                if isinstance(action, Wait):
                    if self._take(await ex.wait_incoming(action.seconds), report):
                        break
                    continue
                assert isinstance(action, Call)
                res = await ex.exchange(PeerID.from_base58(action.peer))
                if self._take(res, report):
                    break
                pause = search.called(action.peer, res.outcome.value, time.monotonic(),
                                      local=res.detail.startswith("local"),
                                      gone=res.detail == f"partner: {NO_FREE_OFFER}")
                if res.outcome is not Outcome.busy:
                    log.info("round=%d partner=%s outcome=%s backoff_s=%.1f detail=%s", round, action.peer,
                             res.outcome.value, search.backoff_of(action.peer, time.monotonic()), res.detail)
                if pause and self._take(await ex.wait_incoming(pause), report):
                    break
        finally:
            self.policy.end()
            for res in await ex.withdraw():
                if res.ok and not report.ok:
                    self._take(res, report)
            if cut is not None:
                self.set_state("training")  # the search is over; our inner steps are running
            if not self.keep_buffers or receive_into is not None:
                await ex.encoded()        # an encode of this offer still running would allocate them again
                ex.staging.release()      # the report holds what the daemon still reads (received, own wire);
                #                           lent tensors unused must not be decoded into in a later round
        report.wait_s = time.monotonic() - t0 - report.transfer_s
        report.passed_over = len(search.passed)
        return report

    def _take(self, res: ExchangeResult | None, report: RoundExchange) -> bool:
        """Fold one exchange result into the round's report; True when it succeeded (the round has its partner)."""
        if res is None:
            return False
        report.attempts += 1
        report.partner, report.outcome, report.detail = res.partner, res.outcome.value, res.detail
        report.code = res.code.name if res.code is not None and not res.ok else None
        report.bytes_sent += res.bytes_sent
        report.bytes_received += res.bytes_received
        report.exchange_s = res.seconds
        report.offer_round, report.partner_round = res.round, res.partner_round
        if not res.ok:
            return False
        report.received, report.kind, report.group_size = res.tensors, "pair", 2
        report.own_wire, report.mix_weight, report.mix_momentum = res.own_wire, res.mix_weight, res.mix_momentum
        report.path = self.net.p2p.path.get(res.partner, "direct")   # direct, or forwarded:<forwarder>
        t0 = self._search_t0
        self.policy.succeeded(res.partner, None if t0 is None else time.monotonic() - res.seconds - t0)
        return True

    def close(self) -> None:
        if self.exchanger is not None:
            self.net.aio.run(self.exchanger.stop(), 10)
