"""DiLoCo as the live peer runs it (`--schedule live` with `search.matchmaking_time_s` set): peer/swarm/diloco.py
on hivemind's DecentralizedAverager, on the virtual clock. One model: groups are keyed by epoch (the outer steps a
worker's model has taken), a worker never steps without its group's mean, and the first group of a run waits for
`initial_group` workers. Each worker cycles

    compute H_i steps -> look at its listing:
        the listed workers' median epoch is past ours -> behind (protocol/epochs.py, the live rule): download the
                                     state of the most advanced worker (its anchor and outer state; 2 messages over
                                     our link), drop the round, compute again from there
        else target = 1 + listed  -> join the group of our epoch that is forming, or open one; a group closes as
                                     soon as it has its opener's target, or matchmaking_time_s after it opened with
                                     whoever came if that is at least 2 (initial_group at epoch 0); else it
                                     declares itself again for another matchmaking_time_s (hivemind 1.1's
                                     Matchmaking keeps looking until the step's timeout; the live peer tries again)
    a closed group of n >= 2 all-reduces (the exact mean of the members' pseudo-gradients) and every member applies
    it when the all-reduce ends: setup + the ring all-reduce over the members' links (sim/clock.py), times a factor
    drawn uniformly with mean 1 and coefficient of variation `jitter` (measured on the bench: 0.10 for groups of 6,
    20-26 s).

History: until 2026-12-05 the live DiLoCo had no epochs, rounded solo when it listed nobody and applied partial
groups' means to each member's own anchor, so the partial groups of a run's first seconds forked the model into
lineages that never merged (members of one 6-peer group kept validation losses up to 0.5 nats apart to the end of
bench/hetero.py's runs; docs/hetero-results.md). This engine modelled that; it now models the DiLoCo that
replaced it.

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

from gasloc.protocol.epochs import behind
from gasloc.sim.clock import Link, allreduce_seconds
from gasloc.sim.engine import Engine, Trainer


def start_listings(k: int, discovery_share: float, seed: int) -> list[frozenset[int]]:
    """Who each worker lists before discovery_s: each other worker with probability `discovery_share` (its own RNG,
    so the draw is the same for every algorithm of a seed)."""
    rng = random.Random(seed * 7_919 + 17)
    return [frozenset(j for j in range(k) if j != i and rng.random() < discovery_share) for i in range(k)]


class GroupEngine(Engine):
    """Drives a Trainer through DiLoCo rounds with hivemind's matchmaking keyed by epoch. Iterate `run()`: it yields
    the time of each event."""

    def __init__(self, links: Sequence[Link], *, matchmaking_s: float, discovery_s: float = 0.0,
                 discovery_share: float = 1.0, jitter: float = 0.0, seed: int = 0, initial_group: int | None = None,
                 **common):
        super().__init__(links, **common)
        self.matchmaking_s, self.discovery_s = matchmaking_s, discovery_s
        self.spread = jitter * math.sqrt(3)  # uniform on [1 - spread, 1 + spread] has this coefficient of variation
        self.early = start_listings(self.k, discovery_share, seed)
        self.initial_group = min(self.k, initial_group or self.k)  # the start barrier (diloco.initial_group_size)
        self.events: list[tuple[float, int, str, int]] = []
        self.seq = itertools.count()
        self.epoch = [0] * self.k              # outer steps each worker's model has taken
        self.forming: dict[int, list[int]] = {}  # epoch -> members of its open group (first: its opener)
        self.target: dict[int, int] = {}        # epoch -> its open group's target size
        self.close_at: dict[int, float] = {}    # epoch -> when its open group's pending "close" event is due
        self.groups: list[int] = []            # sizes of the all-reduces that ran (reported)
        self.downloads = 0                     # behind: state downloads instead of a step

    def _at(self, t: float, kind: str, i: int) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, i))

    def listed(self, i: int, t: float) -> list[int]:
        """The other workers worker i's listing holds at time t."""
        return [j for j in range(self.k) if j != i] if t >= self.discovery_s else sorted(self.early[i])

    def minimum(self, epoch: int) -> int:
        return self.initial_group if epoch == 0 else 2

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
            elif kind == "close":  # i is the epoch; a group closed early or re-declared leaves a stale event
                if i in self.forming and self.close_at.get(i) == t:
                    self._close(trainer, i, t)
            elif kind == "downloaded":
                self._start_compute(trainer, i, t)
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
        e, listed = self.epoch[i], self.listed(i, t)
        if self._download_if_behind(trainer, i, t):
            return
        if e not in self.forming:
            self.forming[e], self.target[e] = [i], max(1 + len(listed), self.minimum(e))
            self.close_at[e] = t + self.matchmaking_s
            self._at(self.close_at[e], "close", e)
        else:
            self.forming[e].append(i)
        if len(self.forming[e]) >= self.target[e]:
            self._close(trainer, e, t)

    def _download_if_behind(self, trainer: Trainer, i: int, t: float) -> bool:
        listed = self.listed(i, t)
        if not behind(self.epoch[i], [self.epoch[j] for j in listed]):
            return False
        donor = max(listed, key=lambda j: (self.epoch[j], -j))
        self.downloads += 1
        self.epoch[i] = self.epoch[donor]
        trainer.adopt(i, donor, self.epoch[donor])
        # params and the outer momentum: two messages' bytes over our link
        self._at(t + 2 * self.workers[i].message_bytes * 8 / self.links[i].bandwidth_bps, "downloaded", i)
        return True

    def _close(self, trainer: Trainer, e: int, t: float) -> None:
        # before each new attempt, as the live peer: a member the others left behind downloads instead
        members = self.forming[e] = [i for i in self.forming[e] if not self._download_if_behind(trainer, i, t)]
        if not members:
            del self.forming[e], self.target[e], self.close_at[e]
            return
        if len(members) < self.minimum(e):  # too few came: declare again, with the listing's target of now
            self.target[e] = max(1 + len(self.listed(members[0], t)), self.minimum(e))
            self.close_at[e] = t + self.matchmaking_s
            self._at(self.close_at[e], "close", e)
            return
        del self.forming[e], self.target[e], self.close_at[e]
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
        self.epoch[i] += 1
        self._start_compute(trainer, i, t)

    @property
    def stats(self) -> dict:
        return {"allreduce_groups": {str(n): self.groups.count(n) for n in sorted(set(self.groups))},
                "downloads": self.downloads}
