"""The live schedule (`--schedule live`, the default): each simulated worker runs the live peer's partner search,
protocol/search.py's PartnerPolicy, on the virtual clock. The rule lives there only; this module is its second
driver (the first is peer/swarm/gossip.py) and does on virtual time what the live peer does on its event loop:

    compute H_i steps -> offer + announce "exchanging" -> loop on search.next(sight, now):
        Call(j)   -> the call reaches j after the pair's one-way latency; j accepts if it is searching and neither
                     calling nor exchanging, and its own policy does not decline us (slower-link rule); else BUSY
                     comes back after the same latency and search.called() says how long to pause
        Wait(s)   -> wait s for a caller (an accepted incoming call ends the wait: we have our partner)
        Finish    -> a solo round
    an exchange costs M / min(B_i, B_j) + l_i + l_j (the slower link's time), both apply when it ends; one that
    would pass exchange_timeout_s is cut there and counts as a timeout (backoff) for the caller.

With a round budget (the runner's K x rounds) no worker starts a round once the swarm has started that many: a
worker whose round ends then stops, as a peer with --max-rounds does, and leaves the others' sight. The run ends with
exactly the budget's rounds and tokens, as a lock-step run of the same length; without the budget the workers still
searching when the last round completed had spent their inner steps already (up to K - 1 rounds more: 1.7 % more
tokens than DiLoCo in the paper suite's claim (b) of 2026-12-02).

What each worker knows is what a live peer knows: `live` = its neighbours in the topology (random: everyone),
`ready` = those announcing "exchanging" (searching, calling or exchanging: the listing shows the state, not whether
the peer is free) with the link estimate they publish; `rates` = its own measured bytes/s of the last exchange with
each peer; `own_link` = max(latest rate, LINK_DECAY * previous estimate), as peer/daemon.py keeps it. The listing
is exact (the live one is up to 0.3 s stale), except that with search.discovery_s the first seconds' listings are
partial (sim/groups.py), and calls cost only latency besides the transfer.

Barrier algorithms (DiLoCo's all-reduce, the complete topology) and `local` have no partner search: a live DiLoCo
round waits for every peer, which is what sim/lockstep.py does; the runner uses it for them.
"""
from __future__ import annotations

import collections
import heapq
import itertools
import math
import random
from collections.abc import Iterator, Sequence

from gasloc.protocol.matching import Edge
from gasloc.protocol.partners import Backoff
from gasloc.protocol.search import Call, Finish, PartnerPolicy, Search, SearchRules, Sight, Wait
from gasloc.sim.clock import Link, pair_seconds
from gasloc.sim.engine import Engine, Trainer
from gasloc.sim.groups import start_listings

LINK_DECAY = 0.95  # peer/daemon.py's decay of the own-link estimate per exchange
COMPUTE, SEARCH, CALLING, EXCHANGE, STOPPED = "compute", "search", "calling", "exchange", "stopped"


class LiveEngine(Engine):
    """Drives a Trainer with one PartnerPolicy per worker. Iterate `run()`: it yields the time of each event."""

    def __init__(self, links: Sequence[Link], edges: Sequence[Edge], *, rules: SearchRules, backoff: Backoff,
                 avoid_recent: int, seed: int, discovery_s: float = 0.0, discovery_share: float = 1.0,
                 round_budget: int | None = None, **common):
        super().__init__(links, **common)
        self.rules = rules
        self.round_budget, self.rounds_started = round_budget, 0
        # the listing at the start: until discovery_s each worker lists only some of the others (sim/groups.py)
        self.discovery_s, self.early = discovery_s, start_listings(self.k, discovery_share, seed)
        self.neighbours: list[list[int]] = [[] for _ in range(self.k)]
        for a, b in edges:
            self.neighbours[a].append(b)
            self.neighbours[b].append(a)
        self.names = [f"w{i}" for i in range(self.k)]
        self.index = {n: i for i, n in enumerate(self.names)}
        # each worker's own RNG, as every live peer has its own (seeded here, so a run is reproducible)
        self.policies = [PartnerPolicy(rules, Backoff(backoff.min_backoff_s, backoff.max_backoff_s,
                                                      backoff.busy_cooldown_s),
                                       avoid_recent=avoid_recent, rng=random.Random(seed * 1_000_003 + i))
                         for i in range(self.k)]
        self.searches: list[Search | None] = [None] * self.k
        self.state = [COMPUTE] * self.k
        self.partner: list[int | None] = [None] * self.k
        self.rates: list[dict[str, float]] = [{} for _ in range(self.k)]  # bytes/s of our last exchange with each
        self.own_link = [0.0] * self.k
        self.token = [0] * self.k      # invalidates a worker's pending search step when an incoming call took it
        self.ready_at = [0.0] * self.k  # when a computing worker's inner phase ends (what a live peer estimates)
        self.search_start = [0.0] * self.k
        self.exchange_start = [0.0] * self.k
        self.events: list[tuple[float, int, str, int, int]] = []
        self.rounds_done = 0  # = sum of the workers' rounds, kept as a count: the runner reads it after every event
        self.seq = itertools.count()
        # what the search did, over the whole run (reported in the result)
        self.stats = {"paired_rounds": 0, "solo_rounds": 0, "calls": 0, "busy": 0, "declined": 0, "timeouts": 0,
                      "passed_over": 0}
        # completed exchanges by the two partners' link bandwidths (bits/s, slower first)
        self.pairs: collections.Counter[tuple[float, float]] = collections.Counter()

    @property
    def total_rounds(self) -> int:
        return self.rounds_done

    # ---- events
    def _at(self, t: float, kind: str, i: int, j: int = -1) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, i, j))

    def _latency(self, i: int, j: int) -> float:
        return self.links[i].latency_s + self.links[j].latency_s

    def _start_compute(self, trainer: Trainer, i: int, t: float) -> None:
        w = self.workers[i]
        if self.round_budget is not None and self.rounds_started >= self.round_budget:
            self.state[i] = STOPPED
            return
        self.rounds_started += 1
        self.state[i], w.planned_steps = COMPUTE, self.steps_for(i)
        trainer.plan(i, w.planned_steps)
        self.ready_at[i] = t + w.planned_steps * self.links[i].seconds_per_step
        self._at(self.ready_at[i], "computed", i)

    def _sight(self, i: int) -> Sight:
        names, state = self.names, self.state
        nb = [j for j in self.neighbours[i] if state[j] != STOPPED]
        if self.now < self.discovery_s:
            nb = [j for j in nb if j in self.early[i]]
        return Sight(live=[names[j] for j in nb],
                     ready={names[j]: self.own_link[j] for j in nb if state[j] != COMPUTE},
                     rates=self.rates[i], own_link=self.own_link[i],
                     training={names[j]: self.ready_at[j] for j in nb if state[j] == COMPUTE})

    def run(self, trainer: Trainer, horizon_s: float = math.inf) -> Iterator[float]:
        """Process events in virtual-time order, yielding after each; ends before an event later than
        `horizon_s`. The caller stops iterating when its own stop condition holds."""
        for i in range(self.k):
            self._start_compute(trainer, i, 0.0)
        while self.events:
            t, _, kind, i, j = heapq.heappop(self.events)
            if t > horizon_s:
                return
            self.now = t
            if kind == "computed":
                self._computed(trainer, i, t)
            elif kind == "step":
                if j == self.token[i] and self.state[i] == SEARCH:
                    self._step(trainer, i, t)
            elif kind == "arrive":
                self._arrive(trainer, i, j, t)
            elif kind == "busy":
                self._answered_busy(i, j, t)
            elif kind == "timeout":
                self._timed_out(trainer, i, j, t)
            else:  # "done": the exchange of i (caller) and j ended
                self._done(trainer, i, j, t)
            yield t
        raise RuntimeError("simulated swarm ran out of events")  # every worker always has one pending

    def _computed(self, trainer: Trainer, i: int, t: float) -> None:
        w = self.workers[i]
        trainer.inner(i, w.planned_steps)
        w.steps += w.planned_steps
        w.message_bytes = self.wire_bytes(trainer.send(i))
        w.ready_at = self.search_start[i] = t
        self.searches[i] = self.policies[i].begin(t)  # offer, then announce "exchanging" (gossip.py's order)
        self.state[i] = SEARCH
        self._step(trainer, i, t)

    def _step(self, trainer: Trainer, i: int, t: float) -> None:
        action = self.searches[i].next(self._sight(i), t)
        if isinstance(action, Finish):
            self._finish_round(trainer, i, t, None)
        elif isinstance(action, Wait):
            self._wait(i, t + action.seconds)
        else:
            assert isinstance(action, Call)
            j = self.index[action.peer]
            self.state[i] = CALLING
            self.stats["calls"] += 1
            self._at(t + self._latency(i, j), "arrive", i, j)

    def _wait(self, i: int, until: float) -> None:
        self.token[i] += 1
        self._at(until, "step", i, self.token[i])

    def _arrive(self, trainer: Trainer, i: int, j: int, t: float) -> None:
        """i's call reaches j: j accepts it or answers BUSY (engaged, training, or declining a much slower link)."""
        if self.state[j] != SEARCH:
            self._at(t + self._latency(i, j), "busy", i, j)
            return
        if self.policies[j].declines(self.names[i], self.rates[j].get(self.names[i], 0.0), self.own_link[j], t):
            self.stats["declined"] += 1
            self._at(t + self._latency(i, j), "busy", i, j)
            return
        self.token[j] += 1  # j's pending wait is over: it has a partner
        self.state[i] = self.state[j] = EXCHANGE
        self.partner[i], self.partner[j] = j, i
        self.exchange_start[i] = self.exchange_start[j] = t
        # both read each other's outgoing tensors now, before either applies
        trainer.mix_round({i: [j], j: [i]})
        wi, wj = self.workers[i], self.workers[j]
        # the call's one-way latency is already spent; the transfer and its acknowledgement follow
        cost = pair_seconds(max(wi.message_bytes, wj.message_bytes), self.links[i], self.links[j])
        if cost > self.rules.exchange_timeout_s:
            self._at(t + self.rules.exchange_timeout_s, "timeout", i, j)
        else:
            self._at(t + cost, "done", i, j)
        wi.bytes_sent += wi.message_bytes
        wj.bytes_sent += wj.message_bytes

    def _answered_busy(self, i: int, j: int, t: float) -> None:
        self.stats["busy"] += 1
        self.state[i] = SEARCH
        pause = self.searches[i].called(self.names[j], "busy", t)
        self._wait(i, t + pause)

    def _timed_out(self, trainer: Trainer, i: int, j: int, t: float) -> None:
        """The exchange passed exchange_timeout_s: nothing is mixed; the caller backs off from j, both search on."""
        self.stats["timeouts"] += 1
        for a in (i, j):
            trainer.mix_round({a: []})  # discard the mix computed at the start: the exchange did not complete
            self.state[a], self.partner[a] = SEARCH, None
        self.searches[i].called(self.names[j], "timeout", t)
        self._step(trainer, i, t)
        self._step(trainer, j, t)

    def _done(self, trainer: Trainer, i: int, j: int, t: float) -> None:
        # what the live peer measures: the bytes it received over the exchange's duration
        rate = max(self.workers[i].message_bytes, self.workers[j].message_bytes) / (t - self.exchange_start[i])
        for a, b in ((i, j), (j, i)):
            self.rates[a][self.names[b]] = rate
            self.own_link[a] = max(rate, LINK_DECAY * self.own_link[a])
            self.policies[a].succeeded(self.names[b])
        self.pairs[tuple(sorted((self.links[i].bandwidth_bps, self.links[j].bandwidth_bps)))] += 1
        for a, b in ((i, j), (j, i)):
            self._finish_round(trainer, a, t, b)

    def _finish_round(self, trainer: Trainer, i: int, t: float, partner: int | None) -> None:
        w = self.workers[i]
        s = self.searches[i]
        self.stats["passed_over"] += len(s.passed)
        if partner is None:
            trainer.mix_round({i: []})
            self.stats["solo_rounds"] += 1
            w.idle_s += t - self.search_start[i]
        else:
            self.stats["paired_rounds"] += 1
            w.idle_s += self.exchange_start[i] - self.search_start[i]  # the wait for a partner, not the transfer
        self.policies[i].end()
        self.searches[i] = None
        trainer.apply(i)
        w.rounds += 1
        self.rounds_done += 1
        self.partner[i] = None
        self._start_compute(trainer, i, t)
