"""DiLoCo as the live peer runs it (sim/groups.py): hivemind's matchmaking keyed by epoch on the virtual clock, with a
fake trainer (no torch); the link efficiency of the clock; and bench/hetero_calibrate.py on hand-made metrics."""
from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

import pytest

from gasloc.sim.clock import Link, allreduce_seconds, build_links
from gasloc.sim.config import ClockConfig, SimConfig
from gasloc.sim.groups import GroupEngine, start_listings

NBYTES = 1_000_000


class FakeTrainer:
    def __init__(self):
        self.engine = None
        self.groups: list[tuple[float, tuple[int, ...]]] = []
        self.solo: list[tuple[float, int]] = []
        self.applied: list[tuple[float, int]] = []
        self.adopted: list[tuple[float, int, int, int]] = []

    def plan(self, i, steps):
        pass

    def inner(self, i, steps):
        pass

    def send(self, i):
        return NBYTES

    def mix_round(self, partners):
        for i, ps in partners.items():
            assert ps == []
            self.solo.append((self.engine.now, i))

    def allreduce(self, workers):
        self.groups.append((self.engine.now, tuple(workers)))

    def apply(self, i):
        self.applied.append((self.engine.now, i))

    def adopt(self, i, j, epoch):
        self.adopted.append((self.engine.now, i, j, epoch))


def drive(links, until_s, *, steps=10, nbytes=NBYTES, **kw):
    e = GroupEngine(links, barrier=True, communicates=True, steps_for=lambda i: steps,
                    wire_bytes=lambda n: float(nbytes), rng=random.Random(0), **{"matchmaking_s": 5.0, **kw})
    tr = FakeTrainer()
    tr.engine = e
    for _ in e.run(tr, until_s):
        pass
    return e, tr


@pytest.mark.timeout(30)
def test_with_full_listings_and_equal_clocks_every_group_is_the_whole_swarm_as_in_lock_step():
    links = [Link(0.1, 30e6, 0.0)] * 4
    e, tr = drive(links, 30.0)
    round_s = 10 * 0.1 + allreduce_seconds(NBYTES, links)
    assert [g for _, g in tr.groups] == [(0, 1, 2, 3)] * len(tr.groups) and len(tr.groups) >= 3
    assert [t for t, _ in tr.groups[:3]] == pytest.approx([1.0, 1.0 + round_s, 1.0 + 2 * round_s])
    assert not tr.solo and e.stats["allreduce_groups"] == {"4": len(tr.groups)}


@pytest.mark.timeout(30)
def test_no_solo_round_ever_and_the_start_barrier_waits_for_everyone():
    # listings empty for the first 3.5 s: nobody rounds alone; the first group is the whole swarm (start barrier);
    # the next one, closed at a target of 2 (each lists nobody yet), leaves the third behind: it downloads the
    # pair's state once its listing shows them past its epoch (again while the pair steps on without it), until
    # the three meet in one group again
    e, tr = drive([Link(0.1, 30e6, 0.0)] * 3, 30.0, discovery_s=3.5, discovery_share=0.0)
    assert not tr.solo
    assert tr.groups[0] == (pytest.approx(1.0), (0, 1, 2)) and len(tr.groups[1][1]) == 2
    assert tr.adopted and all(i == 2 for _, i, _, _ in tr.adopted) and e.stats["downloads"] == len(tr.adopted)
    assert [len(g) for _, g in tr.groups[-5:]] == [3] * 5
    # a barrier of 3 out of 4 workers, the fourth computing 20x longer: the first group is the three
    links = [Link(0.1, 30e6, 0.0)] * 3 + [Link(2.0, 30e6, 0.0)]
    _, tr = drive(links, 8.0, initial_group=3)
    assert tr.groups[0] == (pytest.approx(1.0 + 5.0), (0, 1, 2))


@pytest.mark.timeout(30)
def test_a_group_closes_with_whoever_came_when_the_matchmaking_time_is_up():
    # worker 2 computes 20 s: the other two form their group 5 s after the first was ready, without it
    links = [Link(0.1, 30e6, 0.0), Link(0.2, 30e6, 0.0), Link(2.0, 30e6, 0.0)]
    e, tr = drive(links, 30.0, initial_group=2)
    assert tr.groups[0] == (pytest.approx(1.0 + 5.0), (0, 1))
    # worker 2, ready at 20 s at epoch 0, is behind the others: it downloads the most advanced state instead of
    # stepping (a group of its own epoch would never form), then computes again from there
    assert tr.adopted and tr.adopted[0][:2] == (pytest.approx(20.0), 2) and tr.adopted[0][2] in (0, 1)
    assert tr.adopted[0][3] >= 2 and e.stats["downloads"] >= 1
    assert all(2 not in g or len(g) >= 2 for _, g in tr.groups)


@pytest.mark.timeout(30)
def test_a_lone_opener_keeps_looking_instead_of_a_solo_round():
    # worker 1 is ready 18 s after worker 0: worker 0 declares itself again every 5 s and waits (hivemind), it does
    # not round alone; once worker 1 joins, the group is full (target 2)
    links = [Link(0.1, 30e6, 0.0), Link(1.9, 30e6, 0.0)]
    _, tr = drive(links, 25.0)
    assert not tr.solo
    assert tr.groups[0] == (pytest.approx(19.0), (0, 1))


@pytest.mark.timeout(30)
def test_partial_listings_at_the_start_no_longer_split_the_swarm():
    # the bench's start (listings filling for 2.5 s): with epochs and the start barrier every group is all six
    # (the DiLoCo before 2026-12-05 split into partial groups here and forked for good)
    links = build_links("hetero-bench", 6, Link(0.042, 1.0, 0.0005))
    early = start_listings(6, 0.33, seed=0)
    assert early == start_listings(6, 0.33, seed=0) and early != start_listings(6, 0.33, seed=1)
    bench = dict(steps=20, nbytes=3_500_000, discovery_s=2.5, discovery_share=0.33, seed=2)  # the tiny preset's bytes
    for jitter in (0.0, 0.1):
        e, tr = drive(links, 150.0, **bench, jitter=jitter)
        assert len(tr.groups) >= 3 and all(len(g) == 6 for _, g in tr.groups), tr.groups
        assert not tr.solo and e.stats["downloads"] == 0


def test_link_efficiency_slows_every_transfer_and_the_all_reduce_may_have_its_own():
    links = [Link(0.1, 30e6, 0.0), Link(0.1, 3e6, 0.0)]
    clock = ClockConfig(link_efficiency=0.5, allreduce_efficiency=0.25)
    assert [x.bandwidth_bps for x in clock.effective(links)] == [15e6, 1.5e6]
    assert [x.bandwidth_bps for x in clock.effective(links, allreduce=True)] == [7.5e6, 0.75e6]
    assert ClockConfig().effective(links) is links
    with pytest.raises(ValueError, match="link_efficiency"):
        ClockConfig(link_efficiency=1.5)


@pytest.mark.timeout(120)
def test_a_live_diloco_run_reports_its_groups_and_keeps_equal_clocks_in_one_group():
    base = {"workers": 3, "model": {"preset": "tiny", "seq_len": 16}, "data": {"batch_size": 2, "val_batches": 1},
            "inner": {"inner_steps": 2, "warmup_steps": 1}, "outer": {"algorithm": "diloco"}, "rounds": 2,
            "eval_every": 1, "clock": {"nominal_params": None}}
    from gasloc.sim.runner import run
    grouped = run(SimConfig.model_validate({**base, "search": {"matchmaking_time_s": 5.0}}))
    lockstep = run(SimConfig.model_validate(base))
    assert grouped["search"] == {"allreduce_groups": {"3": 2}, "downloads": 0}
    assert grouped["final_val_loss"] == lockstep["final_val_loss"]  # the same maths and the same timing
    assert grouped["final_sim_time_s"] == pytest.approx(lockstep["final_sim_time_s"])


# ---- bench/hetero_calibrate.py

_path = Path(__file__).resolve().parents[2] / "bench" / "hetero_calibrate.py"
_spec = importlib.util.spec_from_file_location("hetero_calibrate", _path)
hc = importlib.util.module_from_spec(_spec)
sys.modules["hetero_calibrate"] = hc
_spec.loader.exec_module(hc)


def _write(run_dir: Path, peer: str, events: list[dict]) -> None:
    (run_dir / peer).mkdir(parents=True)
    (run_dir / peer / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events) + '{"cut')


def test_calibration_measures_step_time_efficiencies_and_the_start_listings(tmp_path):
    m = 3_500_000
    g = tmp_path / "out" / "gasloc"
    _write(g, "p0", [{"event": "start", "time": 100.0, "peer_id": "A", "algorithm": "gasloc"},
                     {"event": "round", "time": 110.0, "inner_steps": 20, "compute_s": 0.8, "outcome": "ok",
                      "partner": "B", "bytes_received": m, "transfer_s": m * 8 / 3e6 / 0.75, "round_s": 10.0}])
    _write(g, "p1", [{"event": "start", "time": 100.0, "peer_id": "B", "algorithm": "gasloc"},
                     {"event": "round", "time": 110.0, "inner_steps": 20, "compute_s": 1.2, "outcome": "ok",
                      "partner": "A", "bytes_received": m, "transfer_s": m * 8 / 3e6 / 0.75, "round_s": 10.0}])
    d = tmp_path / "out" / "diloco"
    ar = 2 * (1 / 2) * m
    _write(d, "p0", [{"event": "start", "time": 100.0, "peer_id": "A", "algorithm": "diloco"},
                     {"event": "round", "time": 100.5, "inner_steps": 20, "compute_s": 0.5, "outcome": "solo",
                      "detail": "no other live DiLoCo peer", "round_s": 0.5},
                     {"event": "round", "time": 120.0, "inner_steps": 20, "compute_s": 0.5, "outcome": "ok",
                      "group_size": 2, "partner": "B", "bytes_received": ar, "transfer_s": ar * 8 / 3e6 / 0.5,
                      "detail": "target_group_size=2", "round_s": 19.5}])
    _write(d, "p1", [{"event": "start", "time": 100.0, "peer_id": "B", "algorithm": "diloco"},
                     {"event": "round", "time": 120.0, "inner_steps": 20, "compute_s": 0.5, "outcome": "ok",
                      "group_size": 2, "partner": "A", "bytes_received": ar, "transfer_s": ar * 8 / 3e6 / 0.5,
                      "detail": "target_group_size=2", "round_s": 20.0}])
    res = hc.measure([tmp_path / "out"], 30.0, 3.0)
    assert res["runs"] == 2
    assert res["seconds_per_step"] == pytest.approx(3.5 / 100)  # 5 rounds of 20 steps
    assert res["pair_efficiency"]["fast-slow"] == pytest.approx(0.75) and res["pair_count"]["fast-slow"] == 2
    assert res["allreduce_efficiency"] == pytest.approx(0.5) and res["allreduce_count"] == 2
    assert res["slow_link_efficiency"] == pytest.approx(0.625)
    # p0 listed nobody at its first round (read at 0.5 s), p1 listed its one other peer
    assert res["first_round_listed"] == [0, 1] and res["first_round_listed_share"] == 0.5
    assert res["partial_listing_until_s"] == pytest.approx(0.5) and res["partial_listing_peers"] == 1


def test_calibration_of_a_folder_without_runs_is_a_one_line_error(tmp_path):
    from click.testing import CliRunner
    out = CliRunner().invoke(hc.main, [str(tmp_path)])
    assert out.exit_code != 0 and "no run with peers' metrics.jsonl" in out.output
