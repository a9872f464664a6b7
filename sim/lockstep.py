"""Lock-step rounds on per-worker clocks: the default schedule of `gasloc sim`.

Every worker does round r, then round r+1; only the clocks differ. In a round each worker computes H_i inner steps
on its own clock (H_i * t_i seconds), then this round's matching (protocol.matching.round_partners, the same rule
for every algorithm) pairs workers:

    pair (i, j):   starts at max(c_i, c_j) (both ready), costs M / min(B_i, B_j) + l_i + l_j, advances c_i and
                   c_j only; nobody else waits. With two partners a worker's exchanges run one after the other.
    all-reduce:    (DiLoCo, or the complete topology) starts at max_i c_i and costs the ring all-reduce over the
                   slowest link; every clock ends at the same time.

With overlap (one-round-delayed mixing) a worker starts round r+1 as soon as it has sent round r's message: the
exchange starts when both partners are ready and runs during their next inner steps, and its mix is added after
the inner step during which it arrived (Trainer.arrive); a worker waits only if it finishes those steps before the
exchange ends (it needs the mix before sending again).

A round's results are those of the last worker to finish it, so an evaluation after round r is stamped with
max_i c_i. Compare sim/engine.py, where workers do not share a round counter at all.
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

from gasloc.protocol.matching import Topology, round_partners
from gasloc.sim.clock import Link, allreduce_seconds, pair_seconds
from gasloc.sim.engine import Engine, Trainer


class LockstepEngine(Engine):
    """Drives a Trainer through lock-step rounds. Iterate `run()`: it yields the virtual time after each round."""

    def __init__(self, links: Sequence[Link], topology: Topology, *, overlap: bool = False, **common):
        super().__init__(links, **common)
        self.topology, self.overlap = topology, overlap
        self.clocks = [0.0] * self.k
        self.exchange_end = [0.0] * self.k  # overlap: when the worker's last exchange ends

    def run(self, trainer: Trainer, horizon_s: float = math.inf) -> Iterator[float]:
        """Rounds until the caller stops iterating, or until a round ends past `horizon_s` (that round included)."""
        while self.now <= horizon_s:
            planned = [self.steps_for(i) for i in range(self.k)]
            for i, steps in enumerate(planned):
                trainer.plan(i, steps)
            for i, w in enumerate(self.workers):
                steps = planned[i]
                spt = self.links[i].seconds_per_step
                if self.overlap:  # the previous mix is added after the inner step during which it arrived
                    before = min(steps, max(0, math.ceil((self.exchange_end[i] - self.clocks[i]) / spt - 1e-9)))
                    trainer.inner(i, before)
                    trainer.arrive(i)
                    trainer.inner(i, steps - before)
                else:
                    trainer.inner(i, steps)
                w.steps += steps
                self.clocks[i] += steps * spt
                if self.clocks[i] < self.exchange_end[i]:  # overlap: the previous mix is not here yet
                    w.idle_s += self.exchange_end[i] - self.clocks[i]
                    self.clocks[i] = self.exchange_end[i]
                w.message_bytes = self.wire_bytes(trainer.send(i))
            if not self.communicates:
                trainer.mix_round({i: [] for i in range(self.k)})
            elif self.barrier:
                self._allreduce(trainer)
            else:
                self._pairs(trainer)
            for i, w in enumerate(self.workers):
                trainer.apply(i)
                w.rounds += 1
            self.now = max(self.clocks)
            yield self.now

    def _allreduce(self, trainer: Trainer) -> None:
        start = max(self.clocks)
        nbytes = max(w.message_bytes for w in self.workers)
        end = start + self.allreduce_setup_s + allreduce_seconds(nbytes, self.links)
        trainer.allreduce(list(range(self.k)))
        for i, w in enumerate(self.workers):
            w.bytes_sent += 2 * (self.k - 1) / self.k * nbytes
            if self.overlap:
                self.exchange_end[i] = end
            else:
                w.idle_s += start - self.clocks[i]
                self.clocks[i] = end

    def _pairs(self, trainer: Trainer) -> None:
        partners = round_partners(self.topology, self.k, self.rng, num_partners=self.num_partners,
                                  weights=self.weights)
        trainer.mix_round({i: partners[i] for i in range(self.k)})
        for i, j in sorted({(min(a, b), max(a, b)) for a in range(self.k) for b in partners[a]}):
            wi, wj = self.workers[i], self.workers[j]
            start = max(self.clocks[i], self.clocks[j])  # both ready
            if self.overlap:  # a worker's exchanges of one round (two partners) still run one after the other
                start = max(start, self.exchange_end[i], self.exchange_end[j])
            wi.bytes_sent += wi.message_bytes
            wj.bytes_sent += wj.message_bytes
            end = start + pair_seconds(max(wi.message_bytes, wj.message_bytes), self.links[i], self.links[j])
            if self.overlap:  # nobody waits now: the exchange runs during both workers' next inner steps
                self.exchange_end[i] = max(self.exchange_end[i], end)
                self.exchange_end[j] = max(self.exchange_end[j], end)
            else:
                wi.idle_s += start - self.clocks[i]
                wj.idle_s += start - self.clocks[j]
                self.clocks[i] = self.clocks[j] = end
