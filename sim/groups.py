"""DiLoCo as the live peer runs it (`--schedule live` with `search.matchmaking_time_s` set): peer/swarm/diloco.py
on hivemind's DecentralizedAverager, on the virtual clock. Each worker cycles

    compute H_i steps -> look at its listing:
        nobody else listed        -> a solo round at once (diloco.py: "no other live DiLoCo peer", no wait)
        else target = 1 + listed  -> join the group that is forming, or open one; a group closes as soon as it has
                                     its opener's target, or matchmaking_time_s after it opened with whoever came;
                                     a lone opener declares itself again for another matchmaking_time_s (hivemind
                                     1.1's Matchmaking keeps looking until the step's timeout)
    a closed group of n >= 2 all-reduces (the exact mean of the members' pseudo-gradients) and every member applies
    it when the all-reduce ends: setup + the ring all-reduce over the members' links (sim/clock.py), times a factor
    drawn uniformly with mean 1 and coefficient of variation `jitter` (measured on the bench: 0.10 for groups of 6,
    20-26 s). Without it, two partial groups with equally slow members keep a constant offset and never merge; on
    the bench they merged into one group of 6 within 30-45 s in all three invocations T-V.

Why not lock-step: on bench/hetero.py a live DiLoCo round does not wait for every peer. While the listings are
incomplete (the first seconds of a run), peers average in partial groups or alone, and since DiLoCo averages
pseudo-gradients (anchor - theta) and never the anchors, those lineages never merge again: measured in the
invocations of 2026-12-01 18:16-18:52 (T-V), members of one 6-peer group kept validation losses up to 0.5 nats
apart to the end of the run (docs/sim-results.md). Lock-step averages everyone from round 1, so it cannot show that.

The listing at the start: until `discovery_s`, worker i lists only a fixed random subset of the others (each with
probability `discovery_share`, drawn from the run's seed); afterwards everyone. discovery_s = 0 lists everyone from
the start; then, on equal clocks, every group is the whole swarm and the schedule is lock-step's.
"""
from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Iterator, Sequence

from gasloc.sim.clock import Link, allreduce_seconds
from gasloc.sim.engine import Engine, Trainer


def start_listings(k: int, discovery_share: float, seed: int) -> list[frozenset[int]]:
    """Who each worker lists before discovery_s: each other worker with probability `discovery_share` (its own RNG,
    so the draw is the same for every algorithm of a seed)."""
    rng = random.Random(seed * 7_919 + 17)
    return [frozenset(j for j in range(k) if j != i and rng.random() < discovery_share) for i in range(k)]


class GroupEngine(Engine):
    """Drives a Trainer through DiLoCo rounds with hivemind's matchmaking. Iterate `run()`: it yields the time of
    each event."""

    def __init__(self, links: Sequence[Link], *, matchmaking_s: float, discovery_s: float = 0.0,
                 discovery_share: float = 1.0, jitter: float = 0.0, seed: int = 0, **common):
        super().__init__(links, **common)
        self.matchmaking_s, self.discovery_s = matchmaking_s, discovery_s
        self.spread = jitter * math.sqrt(3)  # uniform on [1 - spread, 1 + spread] has this coefficient of variation
        self.early = start_listings(self.k, discovery_share, seed)
        self.events: list[tuple[float, int, str, int]] = []
        self.seq = itertools.count()
        self.forming: list[int] | None = None  # members of the group that is still open (first: its opener)
        self.target = 0                        # the opener's target group size
        self.group_id = 0                      # which open group a pending "close" event belongs to
        self.groups: list[int] = []            # sizes of the all-reduces that ran (reported)
        self.solo_alone = 0                    # solo rounds because nobody was listed

    def _at(self, t: float, kind: str, i: int) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, i))

    def listed(self, i: int, t: float) -> int:
        """How many other workers worker i's listing holds at time t."""
        return self.k - 1 if t >= self.discovery_s else len(self.early[i])

    def _start_compute(self, trainer: Trainer, i: int, t: float) -> None:
        w = self.workers[i]
        w.planned_steps = self.steps_for(i)
        trainer.plan(i, w.planned_steps)
        self._at(t + w.planned_steps * self.links[i].seconds_per_step, "computed", i)

    def run(self, trainer: Trainer, horizon_s: float = math.inf) -> Iterator[float]:
        for i in range(self.k):
            self._start_compute(trainer, i, 0.0)
        while self.events:
            t, _, kind, i = heapq.heappop(self.events)
            if t > horizon_s:
                return
            self.now = t
            if kind == "computed":
                self._computed(trainer, i, t)
            elif kind == "close":
                if i == self.group_id and self.forming is not None:
                    self._close(trainer, t)
            else:  # "applied": worker i's all-reduce ended
                self._finish(trainer, i, t)
            yield t
        raise RuntimeError("simulated swarm ran out of events")

    def _computed(self, trainer: Trainer, i: int, t: float) -> None:
        w = self.workers[i]
        trainer.inner(i, w.planned_steps)
        w.steps += w.planned_steps
        w.message_bytes = self.wire_bytes(trainer.send(i))
        w.ready_at = t
        listed = self.listed(i, t)
        if listed == 0:  # a lone peer does not wait at all
            self.solo_alone += 1
            trainer.mix_round({i: []})
            self._finish(trainer, i, t)
            return
        if self.forming is None:
            self.forming, self.target = [i], 1 + listed
            self.group_id += 1
            self._at(t + self.matchmaking_s, "close", self.group_id)
        else:
            self.forming.append(i)
        if len(self.forming) >= self.target:
            self._close(trainer, t)

    def _close(self, trainer: Trainer, t: float) -> None:
        if len(self.forming) < 2:  # nobody came: declare again, with the listing's target of now
            self.target = 1 + self.listed(self.forming[0], t)
            self.group_id += 1
            self._at(t + self.matchmaking_s, "close", self.group_id)
            return
        members, self.forming = self.forming, None
        for i in members:
            self.workers[i].idle_s += t - self.workers[i].ready_at
        self.groups.append(len(members))
        nbytes = max(self.workers[i].message_bytes for i in members)
        cost = allreduce_seconds(nbytes, [self.links[i] for i in members])
        if self.spread:
            cost *= self.rng.uniform(1 - self.spread, 1 + self.spread)
        end = t + self.allreduce_setup_s + cost
        trainer.allreduce(members)
        n = len(members)
        for i in members:
            self.workers[i].bytes_sent += 2 * (n - 1) / n * nbytes
            self._at(end, "applied", i)

    def _finish(self, trainer: Trainer, i: int, t: float) -> None:
        trainer.apply(i)
        self.workers[i].rounds += 1
        self._start_compute(trainer, i, t)

    @property
    def stats(self) -> dict:
        return {"allreduce_groups": {str(n): self.groups.count(n) for n in sorted(set(self.groups))},
                "solo_alone": self.solo_alone}
