"""The asynchronous schedule (`--schedule async`): an event loop over per-worker virtual clocks with no shared round
counter. (The default, lock-step schedule is sim/lockstep.py; both share the Trainer protocol and WorkerState.)

No torch here: the tensor work is delegated to a `Trainer` (sim/runner.py; tests pass a fake), so the clock model
can be tested on its own. Each worker cycles

    compute (H_i inner steps, H_i * t_i seconds) -> wait for partner(s) -> exchange (link cost) -> apply -> ...

Pairs form among the workers that are waiting at the same moment (FIFO in virtual time: a worker that becomes
ready takes a neighbour that is already waiting); an exchange starts when both partners are ready, costs only their
link, and nobody else waits. A worker whose wait passes `match_timeout_s` does a solo round, as a live peer does.
In barrier mode (DiLoCo's all-reduce, or the complete topology) a round starts only when every worker is waiting,
and the all-reduce is gated by the slowest link. With equal speeds and links every worker is ready at the same
instant, so the swarm moves in lock-step rounds; with unequal ones, fast workers do more rounds.

Known artefact: clocks here have no jitter, so workers whose phases lock together keep meeting only each other
(e.g. two fast workers that finish every exchange at the same instant re-pair forever); such cliques never average
with the rest of the swarm. A live swarm has the same risk if its matcher is first-come first-served.

The tensor work of a compute phase runs when the phase ends (its "ready" event), so at any virtual time each
worker's parameters are those of its last finished event: evaluations see a consistent snapshot.
"""
from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from gasloc.protocol.matching import Edge, random_matching
from gasloc.sim.clock import Link, allreduce_seconds, pair_seconds

COMPUTE, WAIT, EXCHANGE = "compute", "wait", "exchange"
SAME_TIME_S = 1e-9  # events closer than this are simultaneous (equal float sums can differ in the last bit)


class Trainer(Protocol):
    def plan(self, i: int, steps: int) -> None:
        """Worker i starts an inner phase of `steps` steps now (the live and lock-step schedules announce it, so a
        batched trainer may run many workers' phases at once; sim/batched.py)."""

    def inner(self, i: int, steps: int) -> None:
        """Worker i's inner phase of `steps` steps ends now: run it (or it has already run, batched)."""

    def send(self, i: int) -> int:
        """Prepare worker i's outgoing tensors (outer.outgoing); return how many numbers they hold."""

    def mix_round(self, partners: Mapping[int, list[int]]) -> None:
        """Compute the mixed tensors of every worker in one matching from its partners' outgoing ones (symmetric:
        j in partners[i] iff i in partners[j]); a worker with no partners has a solo round."""

    def allreduce(self, workers: list[int]) -> None:
        """Give every worker the mean over all of them (DiLoCo's all-reduce)."""

    def apply(self, i: int) -> None:
        """Apply worker i's outer update with its mixed tensors."""

    def adopt(self, i: int, j: int, epoch: int) -> None:
        """DiLoCo (sim/groups.py): worker i fell behind; it takes over worker j's state at j's last outer step
        (epoch `epoch`), dropping its own round."""

    def arrive(self, i: int) -> None:
        """Overlap (lockstep only): worker i's previous mix arrived; add it now, between two inner steps."""


@dataclass
class WorkerState:
    phase: str = COMPUTE
    until: float = 0.0          # compute: when it ends; exchange: when it ends; wait: unused
    ready_at: float = 0.0       # when the worker last became ready (started waiting)
    rounds: int = 0
    steps: int = 0
    planned_steps: int = 0      # H_i of the current compute phase
    message_bytes: float = 0.0  # bytes of its current outgoing message (on the simulated wire)
    bytes_sent: float = 0.0
    idle_s: float = 0.0         # time spent waiting for partners


class Engine:
    """What both schedules share (this one and sim/lockstep.py): the workers, their links, and the bookkeeping."""

    def __init__(self, links: Sequence[Link], *, barrier: bool, communicates: bool,
                 steps_for: Callable[[int], int], wire_bytes: Callable[[int], float], rng: random.Random,
                 num_partners: int = 1, weights: Mapping[Edge, float] | None = None, allreduce_setup_s: float = 0.0):
        self.links = list(links)
        self.k = len(self.links)
        self.barrier, self.communicates = barrier, communicates
        self.steps_for, self.wire_bytes, self.rng = steps_for, wire_bytes, rng
        self.num_partners, self.weights = num_partners, weights
        self.allreduce_setup_s = allreduce_setup_s
        self.workers = [WorkerState() for _ in range(self.k)]
        self.now = 0.0

    @property
    def total_rounds(self) -> int:
        return sum(w.rounds for w in self.workers)

    @property
    def total_steps(self) -> int:
        return sum(w.steps for w in self.workers)


class AsyncEngine(Engine):
    """Drives a Trainer through rounds on virtual clocks. Iterate `run()`: it yields after each instant."""

    def __init__(self, links: Sequence[Link], edges: Sequence[Edge], *, match_timeout_s: float | None = None,
                 **common):
        super().__init__(links, **common)
        self.edges, self.match_timeout_s = list(edges), match_timeout_s

    # ---- bookkeeping
    def _next_time(self, w: WorkerState) -> float:
        if w.phase == WAIT:
            if self.barrier or self.match_timeout_s is None:
                return math.inf
            return w.ready_at + self.match_timeout_s
        return w.until

    def next_event_time(self) -> float:
        return min(self._next_time(w) for w in self.workers)

    def _start_compute(self, i: int, t: float) -> None:
        w = self.workers[i]
        w.phase, w.planned_steps = COMPUTE, self.steps_for(i)
        w.until = t + w.planned_steps * self.links[i].seconds_per_step

    def _finish_round(self, trainer: Trainer, i: int, t: float) -> None:
        trainer.apply(i)
        self.workers[i].rounds += 1
        self._start_compute(i, t)

    # ---- the loop
    def run(self, trainer: Trainer, horizon_s: float = math.inf) -> Iterator[float]:
        """Process instants in virtual-time order, yielding each one; ends before any event later than
        `horizon_s`. The caller stops iterating when its own stop condition holds."""
        for i in range(self.k):
            self._start_compute(i, 0.0)
        while True:
            t = self.next_event_time()
            if t == math.inf:
                raise RuntimeError("simulated swarm deadlocked: every worker waits and no pair can form")
            if t > horizon_s:
                return
            self.now = t
            for i, w in enumerate(self.workers):
                if self._next_time(w) > t + SAME_TIME_S:
                    continue
                if w.phase == COMPUTE:
                    trainer.inner(i, w.planned_steps)
                    w.steps += w.planned_steps
                    w.message_bytes = self.wire_bytes(trainer.send(i))
                    if self.communicates:
                        w.phase, w.ready_at = WAIT, t
                    else:
                        trainer.mix_round({i: []})
                        self._finish_round(trainer, i, t)
                elif w.phase == EXCHANGE:
                    self._finish_round(trainer, i, t)
                else:  # waited past the timeout: a solo round (mix is the identity), as a live peer does
                    w.idle_s += t - w.ready_at
                    trainer.mix_round({i: []})
                    self._finish_round(trainer, i, t)
            self._match(trainer, t)
            yield t

    def _match(self, trainer: Trainer, t: float) -> None:
        waiting = [i for i, w in enumerate(self.workers) if w.phase == WAIT]
        if self.barrier:
            if len(waiting) == self.k:
                self._allreduce(trainer, t)
            return
        if len(waiting) < 2:
            return
        pool = set(waiting)
        edges = [e for e in self.edges if e[0] in pool and e[1] in pool]
        if not edges:
            return
        partners: list[list[int]] = [[] for _ in range(self.k)]
        for _ in range(self.num_partners):  # the union of one or two matchings, as protocol.round_partners does
            for i, ps in enumerate(random_matching(self.k, edges, self.rng, self.weights)):
                partners[i].extend(p for p in ps if p not in partners[i])
        matched = [i for i in waiting if partners[i]]
        # every mix reads the partners' outgoing tensors now, before anyone applies
        trainer.mix_round({i: partners[i] for i in matched})
        for i in matched:
            w = self.workers[i]
            # with two partners the worker sends its message twice, one exchange after the other
            cost = sum(pair_seconds(w.message_bytes, self.links[i], self.links[j]) for j in partners[i])
            w.idle_s += t - w.ready_at
            w.bytes_sent += w.message_bytes * len(partners[i])
            w.phase, w.until = EXCHANGE, t + cost

    def _allreduce(self, trainer: Trainer, t: float) -> None:
        nbytes = max(w.message_bytes for w in self.workers)
        cost = self.allreduce_setup_s + allreduce_seconds(nbytes, self.links)
        trainer.allreduce(list(range(self.k)))
        for w in self.workers:
            w.idle_s += t - w.ready_at
            w.bytes_sent += 2 * (self.k - 1) / self.k * nbytes
            w.phase, w.until = EXCHANGE, t + cost
