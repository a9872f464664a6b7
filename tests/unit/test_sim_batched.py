"""Batched inner steps (sim/batched.py) against the per-worker trainer, and the data of more workers than blocks."""
import pytest

from gasloc.runtime.config import ConfigError, resolve
from gasloc.sim.config import SimConfig
from gasloc.sim.runner import run
from gasloc.sim.trainer import worker_data

MICRO = {"workers": 6, "rounds": 4, "eval_every": 2, "model.preset": "micro", "model.seq_len": 32,
         "data.batch_size": 2, "data.val_batches": 1, "inner.inner_steps": 3, "inner.warmup_steps": 4,
         "inner.lr": 3e-3, "clock.nominal_params": 5_000_000}


def cfg(**over) -> SimConfig:
    return resolve(SimConfig, flags={**MICRO, **over}, environ={})


def same_run(over: dict) -> tuple[dict, dict]:
    plain, batched = run(cfg(**over)), run(cfg(**over, batched=True))
    for a, b in zip(plain["evals"], batched["evals"], strict=True):
        assert a["sim_time_s"] == b["sim_time_s"] and a["tokens"] == b["tokens"]
        assert b["val_loss_mean"] == pytest.approx(a["val_loss_mean"], abs=1e-4)
        assert b["val_loss_avg_model"] == pytest.approx(a["val_loss_avg_model"], abs=1e-4)
        assert b["consensus"] == pytest.approx(a["consensus"], rel=1e-3, abs=1e-6)
        assert b["val_loss_workers"] == pytest.approx(a["val_loss_workers"], abs=1e-4)
    assert plain["rounds_per_worker"] == batched["rounds_per_worker"]
    assert plain["search"] == batched["search"]
    assert plain["batching"] is None
    return plain, batched


@pytest.mark.timeout(120)
def test_batched_live_gasloc_is_the_per_worker_run(monkeypatch):
    import gasloc.sim.batched as batched
    monkeypatch.setattr(batched, "TRAIN_CHUNK", 4)  # 6 workers: the vmapped steps and evaluations run in chunks
    monkeypatch.setattr(batched, "EVAL_CHUNK", 4)
    _, b = same_run({"outer.algorithm": "gasloc", "clock.profile": "log-uniform-3-300"})
    # the phases that started before the first one ended ran together: batching happened
    assert b["batching"]["max_workers"] > 4


@pytest.mark.timeout(120)
def test_batched_lockstep_diloco_runs_every_worker_in_one_batch():
    _, b = same_run({"outer.algorithm": "diloco"})
    assert b["batching"] == {"phases": 4, "mean_workers": 6.0, "max_workers": 6}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("decay", [{}, {"inner.total_steps": 10, "inner.decay_type": "linear"}])
def test_batched_with_per_worker_step_counts_and_warmup(decay):
    # time-budgeted rounds: slow workers do fewer steps, so a batch groups workers by step count; with a decay, both
    # trainers decay on the live peer's position (rounds x inner_steps), not on the workers' unequal step counts
    _, b = same_run({"outer.algorithm": "gasloc", "clock.profile": "half-slow-compute-2x",
                     "inner.time_budget_s": 1.8, "inner.inner_steps": 2, **decay})
    # a budget of 1.8 s: 6 steps of 0.3 s per round on the fast half, 3 of 0.6 s on the slow one
    fast, slow = b["inner_steps_per_worker"][:3], b["inner_steps_per_worker"][3:]
    assert all(n % 6 == 0 for n in fast) and min(fast) > max(slow)


def test_the_simulators_decay_follows_rounds_x_inner_steps_as_the_live_peer():
    """A time-budgeted worker takes more steps a round than inner_steps: its warm-up follows its steps, its decay
    the position a live peer has (peer/daemon.py): rounds x inner_steps plus the steps of this round."""
    from gasloc.peer.train.inner import lr_at
    from gasloc.sim.trainer import SimTrainer
    c = cfg(workers=2, **{"inner.inner_steps": 2, "inner.warmup_steps": 4, "inner.total_steps": 10,
                          "inner.decay_type": "linear"})
    t = SimTrainer(c)
    t.inner(0, 6)   # round 1: steps 0-5 at positions 0-5
    assert t.opts[0].param_groups[0]["lr"] == pytest.approx(lr_at(5, c.inner, 5))
    t.inner(0, 6)   # round 2: steps 6-11 at positions 2-7
    assert t.opts[0].param_groups[0]["lr"] == pytest.approx(lr_at(11, c.inner, 7))
    assert lr_at(11, c.inner, 7) == pytest.approx(3e-3 * 0.55) and lr_at(11, c.inner) == pytest.approx(3e-4)


@pytest.mark.parametrize("over", [{"outer.overlap": True, "schedule": "lockstep"}, {"schedule": "async"}])
def test_batched_refuses_what_it_does_not_simulate(over):
    with pytest.raises(ConfigError, match="batched"):
        cfg(batched=True, **over)


def test_more_workers_than_blocks_share_shards_with_their_own_windows():
    c = cfg(workers=300)
    data = worker_data(c)
    shards = data[0].train.blocks
    firsts = [d for d in data if "reader" not in d.train.stream]
    s = len(firsts)
    assert 100 < s < 300  # the embedded corpus has a few hundred blocks
    blocks = [tuple(d.train.blocks) for d in firsts]
    assert len({b for bs in blocks for b in bs}) == sum(map(len, blocks))  # the first S are disjoint
    twin = data[s]
    assert tuple(twin.train.blocks) == tuple(shards) and twin.train.stream != data[0].train.stream
    assert not (twin.next_batch() == data[0].next_batch()).all()
