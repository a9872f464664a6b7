"""bench/low_rank.py, the PowerGossip-style low-rank exchange (issue 32): one power-iteration step recovers a
difference of rank r exactly from a seed both sides share, the simulator's pair keeps its mean through it, the bits
are counted per tensor, and its CLI runs a smoke invocation."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gasloc.runtime.config import resolve
from gasloc.sim.config import SimConfig
from gasloc.sim.trainer import SimTrainer

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
from low_rank import bits_per_param, low_rank_step, low_rank_wire, parse_variant, seeded_q, sends_factors  # noqa: E402


def pair_with_difference_of_rank(rank: int, n: int = 40, m: int = 30) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    ya = torch.randn(n, m, generator=g, dtype=torch.float64)
    d = torch.randn(n, rank, generator=g, dtype=torch.float64) @ torch.randn(rank, m, generator=g,
                                                                             dtype=torch.float64)
    return ya, ya + 0.1 * d


@pytest.mark.parametrize("rank", [1, 3, 8])
def test_a_difference_of_rank_r_is_recovered_by_one_step_from_a_matching_seed(rank):
    ya, yb = pair_with_difference_of_rank(rank)
    approx, _ = low_rank_step(ya, yb, seeded_q(7, 30, rank), torch.float64)
    assert torch.allclose(approx, yb - ya, rtol=0, atol=1e-12)
    # one rank short, the step leaves part of the difference: the exactness above is the rank's, not a given
    short, _ = low_rank_step(ya, yb, seeded_q(7, 30, rank - 1), torch.float64) if rank > 1 else (
        torch.zeros_like(ya), None)
    assert (short - (yb - ya)).abs().max() > 1e-3
    # the other side's orientation gives the same approximation, negated
    back, _ = low_rank_step(yb, ya, seeded_q(7, 30, rank), torch.float64)
    assert torch.allclose(back, -approx, rtol=0, atol=1e-12)


def test_a_warm_start_converges_on_a_fixed_difference_of_higher_rank():
    # PowerGossip's warm start: the Q' of one step starts the next, a power iteration across exchanges
    ya, yb = pair_with_difference_of_rank(12)
    q, errs = seeded_q(1, 30, 4), []
    for _ in range(6):
        approx, q = low_rank_step(ya, yb, q, torch.float64)
        errs.append(float((approx - (yb - ya)).norm()))
    best = torch.linalg.svdvals(yb - ya)[4:].square().sum().sqrt()   # the rank-4 truncation's error (Eckart-Young)
    assert errs[-1] < errs[0] and errs[-1] == pytest.approx(float(best), rel=0.05)


@pytest.mark.parametrize("variant", ["seeded-r2", "warm-r2"])
def test_the_simulators_pair_keeps_its_mean_and_mixes_vectors_exactly(monkeypatch, variant):
    cfg = resolve(SimConfig, flags={"workers": 2, "model.seq_len": 32, "data.batch_size": 2, "guard.enabled": False,
                                    "codec": "mod4-sd", "outer.mix_weight": 0.5}, environ={})
    monkeypatch.setattr(SimTrainer, "_modulo_wire", low_rank_wire(*parse_variant(variant), 16))
    t = SimTrainer(cfg)
    gen = torch.Generator().manual_seed(0)
    a = [p.detach().clone() for p in t.params[0]]
    b = [x + 0.01 * torch.randn(x.shape, generator=gen) for x in a]
    for _ in range(2):   # the second exchange starts from the first's Q' (warm) or a fresh seed
        t.sent = [a, b]
        t.mix_round({0: [1], 1: [0]})
        for z0, z1, x0, x1 in zip(t.mixed[0], t.mixed[1], a, b):
            assert torch.allclose(z0 + z1, x0 + x1, rtol=0, atol=1e-6)
            if x0.dim() == 1:   # sent whole: the pair's mean
                assert torch.equal(z0, z1)
        apart = sum(float((x1 - x0).square().sum()) for x0, x1 in zip(a, b))
        after = sum(float((z1 - z0).square().sum()) for z0, z1 in zip(t.mixed[0], t.mixed[1]))
        assert 0 < after < apart   # closer, not equal: a rank-2 part of a full-rank difference
        a, b = t.mixed[0], t.mixed[1]   # the next exchange starts where this one left the pair
    assert bool(t.__dict__.get("low_rank_q")) == variant.startswith("warm")


def test_bits_count_factors_of_each_matrix_and_whole_vectors():
    shapes = [(256, 128), (128,), (384, 128), (4, 4)]
    total = 256 * 128 + 128 + 384 * 128 + 16
    assert not sends_factors((4, 4), 4, 16) and not sends_factors((128,), 1, 16) and sends_factors((384, 128), 4, 16)
    assert bits_per_param(shapes, 4, 16) == pytest.approx(((384 + 512) * 4 * 16 + (128 + 16) * 32) / total)
    assert bits_per_param(shapes, 4, 32) == pytest.approx(((384 + 512) * 4 * 32 + (128 + 16) * 32) / total)
    with pytest.raises(ValueError):
        parse_variant("seeded-r0")


def test_the_cli_runs_a_smoke_invocation_and_refuses_an_unknown_variant():
    run = subprocess.run([sys.executable, str(BENCH / "low_rank.py"), "--variants", "seeded-r2,warm-r1", "--seeds",
                          "0", "--rounds", "1", "--workers", "2"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [line for line in run.stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [r.split("|")[1].strip() for r in rows] == ["fp32", "seeded-r2", "warm-r1"]
    assert rows[0].split("|")[-2].strip() == "32" and 0 < float(rows[2].split("|")[-2]) < 1
    bad = subprocess.run([sys.executable, str(BENCH / "low_rank.py"), "--variants", "psychic-r4"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "psychic" in bad.stderr and "Traceback" not in bad.stderr
