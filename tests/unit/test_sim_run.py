"""Simulated runs end to end at toy size: the DiLoCo equivalence, determinism, the JSON, bytes and H_i."""
import json

import pytest
import torch

from gasloc.runtime.config import resolve
from gasloc.sim.config import SimConfig
from gasloc.sim.runner import SimTrainer, run

TOY = {"workers": 4, "rounds": 4, "eval_every": 2, "model.seq_len": 32, "data.batch_size": 2,
       "data.val_batches": 1, "inner.inner_steps": 3, "inner.warmup_steps": 2}


def cfg(**over) -> SimConfig:
    return resolve(SimConfig, flags={**TOY, **over}, environ={})


def losses(r, key="val_loss_mean"):
    return [e[key] for e in r["evals"]]


@pytest.fixture(scope="module")
def diloco():
    return run(cfg(**{"outer.algorithm": "diloco"}))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("form", ["B", "C"])
def test_gasloc_on_the_complete_graph_is_diloco(form, diloco):
    d = diloco
    # the same outer hyperparameters as DiLoCo's (GASLoC picks its own from H: 0.1 / 0.9 at H = 3)
    g = run(cfg(**{"outer.algorithm": "gasloc", "outer.form": form, "topology": "complete", "outer.momentum": 0.9,
                   "outer.outer_lr": 0.7}))
    assert losses(g) == pytest.approx(losses(d), rel=1e-5, abs=1e-6)
    assert losses(g, "val_loss_avg_model") == pytest.approx(losses(d, "val_loss_avg_model"), rel=1e-5)
    assert losses(d)[-1] < losses(d)[0] - 0.2  # and it learned something
    assert [e["sim_time_s"] for e in g["evals"]] == [e["sim_time_s"] for e in d["evals"]]
    assert max(e["consensus"] for e in g["evals"]) < 1e-5


@pytest.mark.timeout(60)
def test_form_a_is_not_diloco(diloco):
    d = diloco
    a = run(cfg(**{"outer.algorithm": "gasloc", "outer.form": "A", "topology": "complete", "outer.momentum": 0.9,
                   "outer.outer_lr": 0.7}))
    assert abs(losses(a)[-1] - losses(d)[-1]) > 1e-4 and a["evals"][-1]["consensus"] > 1e-4


@pytest.mark.timeout(60)
def test_same_seed_same_json_and_another_seed_differs():
    c = cfg(**{"outer.algorithm": "gasloc", "topology": "ring"})
    one, two = json.dumps(run(c)), json.dumps(run(c))
    assert one == two
    other = run(cfg(**{"outer.algorithm": "gasloc", "topology": "ring", "seed": 1}))
    assert losses(other) != losses(json.loads(one))


@pytest.mark.timeout(60)
def test_json_schema_and_bytes():
    r = json.loads(json.dumps(run(cfg(**{"outer.algorithm": "noloco"}))))
    assert {"config", "evals", "final_val_loss", "bytes_sent_per_worker"} <= set(r)
    for e in r["evals"]:
        assert {"step", "sim_time_s", "tokens", "val_loss_mean", "val_loss_avg_model", "consensus"} <= set(e)
    assert r["final_val_loss"] == r["evals"][-1]["val_loss_mean"]
    assert [e["step"] for e in r["evals"]] == [0, 6, 12]
    assert r["evals"][-1]["tokens"] == 4 * 12 * 2 * 32
    assert r["config"]["outer"]["algorithm"] == "noloco"
    # NoLoCo sends phi and Delta (two numbers per parameter), fp16 on the wire, one partner per round; the clock
    # charges them at the nominal model size (1e8 parameters by default)
    assert r["bytes_sent_per_worker"] == pytest.approx([4 * 2 * 1e8 * 2.0] * 4)
    assert r["bytes_scale"] == pytest.approx(1e8 / r["model_params"])


@pytest.mark.timeout(60)
def test_bytes_at_the_real_model_size():
    c = cfg(**{"outer.algorithm": "gasloc", "rounds": 2, "eval_every": 2})
    c.clock = c.clock.model_copy(update={"nominal_params": None})
    r = run(c)
    assert r["bytes_scale"] == 1.0
    assert r["bytes_sent_per_worker"] == [2 * r["model_params"] * 2.0] * 4


@pytest.mark.timeout(60)
def test_time_budget_gives_fast_workers_more_steps_and_local_sends_nothing():
    r = run(cfg(**{"outer.algorithm": "local", "clock.profile": "half-slow-compute-2x", "inner.inner_steps": 1,
                   "inner.time_budget_s": 1.2, "rounds": 2}))
    assert r["inner_steps_per_worker"] == [8, 8, 4, 4]  # 0.3 s/step -> 4 per round; 0.6 s/step -> 2
    assert r["bytes_sent_per_worker"] == [0, 0, 0, 0]


def test_two_partner_mixing_uses_symmetric_weights_and_keeps_the_mean():
    # the mixing weights alone: the guard would (rightly) reject these far-apart hand-made models
    t = SimTrainer(cfg(workers=3, **{"num_partners": 2, "guard.enabled": False,
                                          "schedule": "lockstep"}))
    xs = [torch.tensor([0.0, 3.0]), torch.tensor([3.0, 0.0]), torch.tensor([6.0, 6.0])]
    t.sent = [[x] for x in xs]
    t.mix_round({0: [1, 2], 1: [0], 2: [0]})  # worker 0 has two partners: every edge weighs 1/3
    z = [m[0] for m in t.mixed]
    assert torch.allclose(z[0], xs[0] + (xs[1] - xs[0]) / 3 + (xs[2] - xs[0]) / 3)
    assert torch.allclose(z[1], xs[1] + (xs[0] - xs[1]) / 3)
    assert torch.allclose(sum(z), sum(xs))
    t.mix_round({1: [2], 2: [1]})  # a plain pair: the pair mean
    assert torch.allclose(t.mixed[1][0], (xs[1] + xs[2]) / 2) and torch.allclose(t.mixed[2][0], t.mixed[1][0])


def test_a_modulo_codec_mixes_with_its_own_weight_and_keeps_the_pair_mean():
    # mod4-sd pulls by 0.4 where outer.mix_weight is unset (protocol/codec.py Codec.mix_weight), as a live peer does
    for weight, pull in ((None, 0.4), (0.5, 0.5)):
        t = SimTrainer(cfg(workers=2, **{"guard.enabled": False, "codec": "mod4-sd", "outer.mix_weight": weight}))
        gen = torch.Generator().manual_seed(0)
        a = [p.detach().clone() for p in t.params[0]]
        b = [x + 0.01 * torch.randn(x.shape, generator=gen) for x in a]
        t.sent = [a, b]
        t.mix_round({0: [1], 1: [0]})
        for z0, z1, x0, x1 in zip(t.mixed[0], t.mixed[1], a, b):
            assert torch.allclose(z0 + z1, x0 + x1, atol=1e-6)
        # each side moved toward the other by `pull` of the decoded difference (its rounding averages out)
        moved = sum(float(((z - x) * (y - x)).sum()) for z, x, y in zip(t.mixed[0], a, b))
        apart = sum(float((y - x).square().sum()) for x, y in zip(a, b))
        assert moved / apart == pytest.approx(pull, rel=0.05), weight


def schedule_of(c: SimConfig, monkeypatch) -> tuple[list, dict]:
    """A run's pairings, round by round (who mixed with whom, in the order the engine ran them), and its result."""
    rounds, mix_round = [], SimTrainer.mix_round

    def recorded(self, partners):
        rounds.append(sorted((i, tuple(ps)) for i, ps in partners.items()))
        return mix_round(self, partners)

    with monkeypatch.context() as m:   # undone after the run: the next run's recorder wraps the plain method
        m.setattr(SimTrainer, "mix_round", recorded)
        return rounds, run(c)


@pytest.mark.timeout(240)
def test_a_codec_not_charged_meets_the_fp32_runs_partners(monkeypatch):
    # the clock charges fp32 4 bytes a parameter and mod4-sd about half a byte; toy rounds of 0.9 s beside exchanges
    # of 3.2 s (fp32) and 0.4 s (mod4-sd) at the nominal 1e8 parameters, so the bytes move the live schedule
    live = {"workers": 6, "rounds": 4, "schedule": "live", "topology": "random"}
    fp32_rounds, fp32 = schedule_of(cfg(**live, codec="float32"), monkeypatch)
    same_rounds, same = schedule_of(cfg(**live, codec="mod4-sd", **{"clock.charge_codec": False,
                                                                       "clock.bytes_per_param": 4.0}), monkeypatch)
    own_rounds, own = schedule_of(cfg(**live, codec="mod4-sd"), monkeypatch)
    assert len(fp32_rounds) >= 4 and any(ps for r in fp32_rounds for _, ps in r)
    assert same_rounds == fp32_rounds
    assert [e["sim_time_s"] for e in same["evals"]] == [e["sim_time_s"] for e in fp32["evals"]]
    assert same["bytes_sent_per_worker"] == fp32["bytes_sent_per_worker"]
    assert same["final_val_loss"] != fp32["final_val_loss"]     # the codec's rounding is still there
    # charged its own bytes, mod4-sd's exchanges end sooner: another schedule on a shorter clock
    assert own_rounds != fp32_rounds
    assert own["final_sim_time_s"] < fp32["final_sim_time_s"]
    assert sum(own["bytes_sent_per_worker"]) < sum(fp32["bytes_sent_per_worker"]) / 4


@pytest.mark.timeout(60)
def test_async_schedule_lets_fast_workers_do_more_rounds():
    r = run(cfg(**{"schedule": "async", "outer.algorithm": "gossip", "clock.profile": "half-slow-compute-2x",
                   "rounds": 3, "eval_every": 3}))
    fast, slow = r["rounds_per_worker"][:2], r["rounds_per_worker"][2:]
    assert min(fast) > max(slow) and sum(r["rounds_per_worker"]) >= 12
    assert r["evals"][-1]["val_loss_mean"] < r["evals"][0]["val_loss_mean"]


@pytest.mark.timeout(240)
def test_the_guard_leaves_honest_mixing_unchanged_and_rejects_a_poisoned_worker():
    """Issue 11: guard on vs off on honest workers, equal tokens: the same losses (within 0.5%); with one worker
    whose outgoing tensors are scaled x3, the guard rejects it and the others' loss stays near the honest run's."""
    base = {"workers": 4, "rounds": 8, "eval_every": 4, "model.seq_len": 32, "data.batch_size": 2,
            "data.val_batches": 1, "inner.inner_steps": 4, "inner.warmup_steps": 4, "seed": 3, "topology": "random"}
    off = run(resolve(SimConfig, flags={**base, "guard.enabled": False}, environ={}))
    on = run(resolve(SimConfig, flags={**base, "guard.enabled": True}, environ={}))
    assert on["guard"]["accept"] + on["guard"]["clip"] > 0 and off["guard"] == dict.fromkeys(off["guard"], 0)
    for a, b in zip(off["evals"], on["evals"], strict=True):
        assert a["tokens"] == b["tokens"]
        assert b["val_loss_mean"] == pytest.approx(a["val_loss_mean"], rel=0.005)

    cfg = resolve(SimConfig, flags={**base, "guard.enabled": True}, environ={})
    t = SimTrainer(cfg)
    for i in range(4):
        t.inner(i, 4)
        t.send(i)
    t.sent[3] = [3 * x for x in t.sent[3]]  # worker 3 sends its model scaled x3
    t.mix_round({0: [3], 3: [0], 1: [2], 2: [1]})
    assert t.guard_counts["reject"] == 1 and t.mixed[0] is t.sent[0]  # worker 0 stayed solo
    assert all(torch.allclose(a, b) for a, b in zip(t.mixed[1], mix_pair(t.sent[1], t.sent[2])))  # accepted


def mix_pair(a, b):
    return [(x + y) / 2 for x, y in zip(a, b)]
