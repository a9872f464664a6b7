"""The virtual clock: link costs, profiles, and the engine's timing (a fake trainer, no torch work)."""
import json
import random

import pytest

from gasloc.peer.train.inner import InnerConfig, steps_this_round
from gasloc.protocol.matching import graph_edges
from gasloc.runtime.config import ConfigError
from gasloc.sim.clock import Link, allreduce_seconds, build_links, pair_seconds
from gasloc.sim.engine import AsyncEngine
from gasloc.sim.lockstep import LockstepEngine

FAST = Link(seconds_per_step=0.5, bandwidth_bps=1e9, latency_s=0.01)
SLOW = Link(seconds_per_step=0.5, bandwidth_bps=1e8, latency_s=0.01)
M = 1e8  # bytes per message


class FakeTrainer:
    """Records when (virtual time) each worker runs inner steps, mixes and applies."""

    def __init__(self):
        self.engine: AsyncEngine | None = None
        self.log: list[tuple] = []

    def inner(self, i, steps):
        self.log.append(("inner", i, steps, self.engine.now))

    def send(self, i):
        return 1000

    def arrive(self, i):
        self.log.append(("arrive", i, self.engine.now))

    def plan(self, i, steps):
        pass

    def mix_round(self, partners):
        for i, ps in partners.items():
            assert all(i in partners[j] for j in ps)  # symmetric
            self.log.append(("mix", i, tuple(ps), self.engine.now))

    def allreduce(self, workers):
        self.log.append(("allreduce", tuple(workers), self.engine.now))

    def apply(self, i):
        self.log.append(("apply", i, self.engine.now))

    def applies(self, i):
        return [e[2] for e in self.log if e[0] == "apply" and e[1] == i]


def make(links, edges, *, barrier=False, steps=lambda i: 4, timeout=None, communicates=True):
    eng = AsyncEngine(links, edges, barrier=barrier, communicates=communicates, steps_for=steps,
                 wire_bytes=lambda numel: M, rng=random.Random(0), match_timeout_s=timeout)
    tr = FakeTrainer()
    tr.engine = eng
    return eng, tr


def drive(eng, tr, until_rounds):
    for _ in eng.run(tr):
        if min(w.rounds for w in eng.workers) >= until_rounds:
            return


def make_lockstep(links, topology="random", *, barrier=False, steps=lambda i: 4, seed=0, overlap=False):
    eng = LockstepEngine(links, topology, barrier=barrier, communicates=True, steps_for=steps,
                         wire_bytes=lambda numel: M, rng=random.Random(seed), overlap=overlap)
    tr = FakeTrainer()
    tr.engine = eng
    return eng, tr


def partners_in_round(tr, r):
    """{worker: partners} of lock-step round r (0-based), from the trainer's log."""
    rounds = [e for e in tr.log if e[0] == "mix"]
    k = len({e[1] for e in rounds})
    return {e[1]: e[2] for e in rounds[r * k:(r + 1) * k]}


@pytest.mark.parametrize("seed", range(4))
def test_lockstep_pair_exchange_advances_only_the_pair(seed):
    links = [FAST, FAST, FAST, SLOW]
    eng, tr = make_lockstep(links, seed=seed)
    next(eng.run(tr))
    partners = partners_in_round(tr, 0)
    for i in range(4):
        (j,) = partners[i]  # four workers on the complete graph: a perfect matching
        assert eng.clocks[i] == pytest.approx(4 * 0.5 + pair_seconds(M, links[i], links[j]))
    # the pair with the slow worker ended later; the fast pair did not wait for it
    assert eng.now == pytest.approx(2 + pair_seconds(M, FAST, SLOW))
    assert sorted(eng.clocks)[:2] == pytest.approx([2 + pair_seconds(M, FAST, FAST)] * 2)


def test_lockstep_exchange_starts_when_both_are_ready():
    slow_cpu = Link(seconds_per_step=1.5, bandwidth_bps=1e9, latency_s=0.01)
    eng, tr = make_lockstep([FAST, slow_cpu], "ring")
    run = eng.run(tr)
    next(run)
    assert eng.clocks == pytest.approx([6 + pair_seconds(M, FAST, slow_cpu)] * 2)
    assert eng.workers[0].idle_s == pytest.approx(4.0) and eng.workers[1].idle_s == 0
    next(run)
    assert eng.workers[0].rounds == 2 and eng.workers[0].bytes_sent == 2 * M


def test_lockstep_overlap_hides_an_exchange_shorter_than_the_inner_phase():
    eng, tr = make_lockstep([FAST, FAST], "ring", overlap=True)
    run = eng.run(tr)
    for _ in range(3):
        next(run)
    assert eng.clocks == pytest.approx([3 * 2.0] * 2)  # 4 steps of 0.5 s per round, the exchanges hidden
    assert all(w.idle_s == 0 for w in eng.workers)
    assert eng.exchange_end == pytest.approx([6.0 + pair_seconds(M, FAST, FAST)] * 2)  # the last one in flight
    plain, tr2 = make_lockstep([FAST, FAST], "ring")
    run = plain.run(tr2)
    for _ in range(3):
        next(run)
    assert plain.clocks == pytest.approx([3 * (2.0 + pair_seconds(M, FAST, FAST))] * 2)


def test_lockstep_overlap_waits_for_an_exchange_longer_than_the_inner_phase():
    eng, tr = make_lockstep([SLOW, SLOW], "ring", overlap=True)
    run = eng.run(tr)
    next(run)
    next(run)
    x = pair_seconds(M, SLOW, SLOW)  # ~8 s against 2 s of inner steps
    assert eng.clocks == pytest.approx([2.0 + x] * 2)  # round 2's steps ended at 4 s, then its mix arrived
    assert eng.workers[0].idle_s == pytest.approx(x - 2.0)


def test_lockstep_allreduce_is_gated_by_the_slowest_link():
    links = [FAST, FAST, FAST, SLOW]
    eng, tr = make_lockstep(links, barrier=True)
    run = eng.run(tr)
    next(run)
    next(run)
    one = 4 * 0.5 + allreduce_seconds(M, links)
    assert eng.clocks == pytest.approx([2 * one] * 4)
    assert allreduce_seconds(M, links) > allreduce_seconds(M, [FAST] * 4) * 9


def test_lockstep_time_budget_gives_faster_workers_more_steps():
    inner = InnerConfig(inner_steps=2, time_budget_s=6.0)
    links = build_links("half-slow-compute-2x", 4, FAST)
    eng, tr = make_lockstep(links, steps=lambda i: steps_this_round(inner, links[i].seconds_per_step))
    next(eng.run(tr))
    assert {e[1]: e[2] for e in tr.log if e[0] == "inner"} == {0: 12, 1: 12, 2: 6, 3: 6}
    assert all(w.idle_s == 0 for w in eng.workers)  # everyone computed for the same 6 s: nobody waited


def test_link_costs():
    assert pair_seconds(M, FAST, FAST) == pytest.approx(M * 8 / 1e9 + 0.02)
    assert pair_seconds(M, FAST, SLOW) == pytest.approx(M * 8 / 1e8 + 0.02)  # the slower side sets the pace
    # ring all-reduce over 4: 2 (n-1)/n M / min B, plus 2 (n-1) hops of the slowest pair's latency
    assert allreduce_seconds(M, [FAST, FAST, FAST, SLOW]) == pytest.approx(1.5 * M * 8 / 1e8 + 6 * 0.02)
    assert allreduce_seconds(M, [FAST]) == 0.0


def test_pair_exchange_advances_only_the_pair():
    # pairs (0,1) on fast links and (2,3) with worker 3 on a slow link
    eng, tr = make([FAST, FAST, FAST, SLOW], [(0, 1), (2, 3)])
    drive(eng, tr, 2)
    compute = 4 * 0.5
    fast, slow = pair_seconds(M, FAST, FAST), pair_seconds(M, FAST, SLOW)
    assert tr.applies(0)[:2] == pytest.approx([compute + fast, 2 * (compute + fast)])
    assert tr.applies(2)[:2] == pytest.approx([compute + slow, 2 * (compute + slow)])
    assert slow > 5 * fast
    # the fast pair never waited for the slow one: by the slow pair's first apply it was rounds ahead
    assert eng.workers[0].idle_s == 0 and eng.workers[0].rounds > eng.workers[2].rounds


def test_exchange_starts_when_both_partners_are_ready():
    slow_cpu = Link(seconds_per_step=1.5, bandwidth_bps=1e9, latency_s=0.01)
    eng, tr = make([FAST, slow_cpu], [(0, 1)])
    drive(eng, tr, 1)
    mix_time = next(e[3] for e in tr.log if e[0] == "mix")
    assert mix_time == pytest.approx(4 * 1.5)  # worker 0 was ready at 2.0 and waited for worker 1
    assert eng.workers[0].idle_s == pytest.approx(4 * 1.5 - 4 * 0.5)
    assert tr.applies(0)[0] == tr.applies(1)[0] == pytest.approx(6 + pair_seconds(M, FAST, slow_cpu))


def test_allreduce_waits_for_everyone_and_is_gated_by_the_slowest_link():
    links = [FAST, FAST, FAST, SLOW]
    eng, tr = make(links, [], barrier=True)
    drive(eng, tr, 2)
    one = 4 * 0.5 + allreduce_seconds(M, links)
    for i in range(4):
        assert tr.applies(i)[:2] == pytest.approx([one, 2 * one])
    assert [e[0] for e in tr.log].count("allreduce") >= 2
    assert eng.workers[0].bytes_sent == pytest.approx(2 * 2 * 3 / 4 * M)


def test_time_budget_gives_faster_workers_more_steps():
    inner = InnerConfig(inner_steps=2, time_budget_s=6.0)
    links = build_links("half-slow-compute-2x", 4, FAST)
    eng, tr = make(links, graph_edges("random", 4), steps=lambda i: steps_this_round(inner, links[i].seconds_per_step))
    drive(eng, tr, 1)
    first = {e[1]: e[2] for e in tr.log if e[0] == "inner"}
    assert first == {0: 12, 1: 12, 2: 6, 3: 6}
    # every worker's compute phase lasts the budget, so nobody waits for a partner
    assert all(w.idle_s == 0 for w in eng.workers)


def test_timeout_gives_a_solo_round():
    slow_cpu = Link(seconds_per_step=5.0, bandwidth_bps=1e9, latency_s=0.01)
    eng, tr = make([FAST, slow_cpu], [(0, 1)], timeout=1.0)
    drive(eng, tr, 1)
    # worker 0 is ready at 2.0 and alone until 3.0: a solo round, and again and again until worker 1 is ready (20.0)
    assert ("mix", 0, (), 3.0) in tr.log and tr.applies(0)[:3] == [3.0, 6.0, 9.0]
    assert all(e[2] == () for e in tr.log if e[0] == "mix" and e[3] < 20.0)


def test_local_never_waits_or_sends():
    eng, tr = make([FAST, SLOW], [(0, 1)], communicates=False)
    drive(eng, tr, 3)
    assert tr.applies(0)[:3] == pytest.approx([2.0, 4.0, 6.0])
    assert all(w.bytes_sent == 0 for w in eng.workers)


def test_profiles():
    base = Link(0.3, 1e9, 0.025)
    assert build_links("uniform", 3, base) == [base] * 3
    hs = build_links("half-slow-10x", 8, base)
    assert [x.bandwidth_bps for x in hs] == [1e9] * 4 + [1e8] * 4


def test_profile_file_toml_and_json(tmp_path):
    base = Link(0.3, 1e9, 0.025)
    t = tmp_path / "p.toml"
    t.write_text("[[workers]]\nbandwidth_mbps = 50\n\n[[workers]]\nseconds_per_step = 1.0\nlatency_ms = 100\n")
    assert build_links(str(t), 2, base) == [Link(0.3, 5e7, 0.025), Link(1.0, 1e9, 0.1)]
    j = tmp_path / "p.json"
    j.write_text(json.dumps({"workers": [{"bandwidth_mbps": 10}, {}]}))
    assert build_links(str(j), 2, base) == [Link(0.3, 1e7, 0.025), base]


@pytest.mark.parametrize("text,needle", [
    ("[[workers]]\nbandwidth_mbps = 10\n", "lists 1 worker(s) but the simulation has 2"),
    ("[[workers]]\nbandwith_mbps = 10\n[[workers]]\n", "unknown key 'workers.0.bandwith_mbps'"),
    ("[[workers]]\nbandwidth_mbps = -1\n[[workers]]\n", "bad value for 'workers.0.bandwidth_mbps'"),
    ("[[workers]\n", "is not valid TOML"),
])
def test_bad_profile_file_is_one_line(tmp_path, text, needle):
    p = tmp_path / "bad.toml"
    p.write_text(text)
    with pytest.raises(ConfigError) as e:
        build_links(str(p), 2, Link(0.3, 1e9, 0.025))
    assert needle in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="does not exist"):
        build_links(str(tmp_path / "nope.toml"), 2, Link(0.3, 1e9, 0.025))
