"""bench/mod_steps.py, the step-rule experiment for the modulo codec (issue 32): its pair arithmetic keeps the pair's
mean for every rule, decodes the partner within a step where the pair is within range, and its CLI runs a smoke
invocation through the simulator with the table it documents."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
from mod_steps import HALF, RULES, code_pair, sign_pair, simulate, steps_for, wz_pair  # noqa: E402


@pytest.mark.parametrize("rule", ["tensor", "block", "movement"])
@pytest.mark.parametrize("band", [0, 1])
def test_the_pair_mean_is_kept_and_the_partner_read_within_a_step(rule, band):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(1000, generator=g, dtype=torch.float64)
    b = a + 0.01 * torch.randn(1000, generator=g, dtype=torch.float64)
    b[::100] += 1.0                                         # a tenth of a percent far past any range: wraps
    ma, mb = 0.01 * torch.randn(1000, generator=g, dtype=torch.float64), 0.01 * torch.randn(1000, generator=g,
                                                                                             dtype=torch.float64)
    step = steps_for(rule, a, b, ma, mb)
    da, db = code_pair(step, a, b, torch.Generator().manual_seed(1), band=band)
    assert torch.allclose(da + db, a + b, rtol=0, atol=1e-12)          # z_i + z_j = y_i + y_j, wraps and all
    near = torch.ones(1000, dtype=torch.bool)
    near[::100] = False
    per = step.expand(-1, 64).reshape(-1)[:1000]          # each coordinate's step
    within = near & ((b - a).abs() < (HALF - 1 - band) * per)
    assert within.sum() > 900
    assert ((da - b).abs()[within] <= per[within] + 1e-12).all()


def test_one_bit_a_value_reads_the_partners_cell_exactly_where_the_pair_is_within_half_a_step():
    """sign1: a parity bit each way and the receiver's own position in its cell give the same dithered difference a
    multi-bit code would (both sides alike: the pair's mean kept) wherever |b - a| < step / 2; unbiased."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(20000, generator=g, dtype=torch.float64)
    b = a + 0.49 * (2 * torch.rand(20000, generator=g, dtype=torch.float64) - 1)
    got_b, got_a = sign_pair(1.0, a, b, torch.Generator().manual_seed(5))
    u = torch.rand(20000, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    d = torch.floor(b + u) - torch.floor(a + u)
    assert torch.equal(got_b, a + d) and torch.equal(got_a, b - d)
    assert abs(float(d.mean() - (b - a).mean())) < 0.01
    far = a + 0.9                                      # past half a step: the bit no longer says which side
    got_far, _ = sign_pair(1.0, a, far, torch.Generator().manual_seed(5))
    assert float(((got_far - a) < 0).double().mean()) > 0.2


@pytest.mark.parametrize("bits", [1.0, 2.0])
def test_the_wyner_ziv_oracle_keeps_the_pair_mean_and_errs_by_the_rate_distortion_bound(bits):
    """wz: what each side decodes has the least mean squared error a Gaussian code of `bits` a value reaches,
    s^2 2^(-2 bits), block by block (s: the block's own difference RMS), as the best estimate from the code (its
    error uncorrelated with it), and the two sides read the same difference (the pair's mean kept)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64 * 4000, generator=g, dtype=torch.float64)
    small = torch.arange(a.numel()) // 64 % 2 == 0
    scale = torch.where(small, 0.01, 1.0).double()   # every other block's difference 100x smaller
    b = a + scale * torch.randn(a.numel(), generator=g, dtype=torch.float64)
    got_b, got_a = wz_pair(bits, a, b, torch.Generator().manual_seed(3))
    assert torch.allclose(got_b + got_a, a + b, rtol=0, atol=1e-12)
    for sel in (small, ~small):
        err = (got_b - b)[sel].square().mean() / (b - a)[sel].square().mean()
        assert abs(float(err) - 2 ** (-2 * bits)) < 0.01, float(err)
        # the test channel's decode is the best estimate from what it got: its error uncorrelated with it
        got, d = (got_b - a)[sel], (b - a)[sel]
        assert abs(float(((got - d) * got).mean() / d.square().mean())) < 0.01
    assert not torch.equal(wz_pair(bits, a, b, torch.Generator().manual_seed(4))[0], got_b)   # the seed's noise
    # one variance for the tensor (wz-tensor): the same error over the whole, the small blocks' far above theirs
    got_b, got_a = wz_pair(bits, a, b, torch.Generator().manual_seed(3), per_block=False)
    assert torch.allclose(got_b + got_a, a + b, rtol=0, atol=1e-12)
    assert abs(float((got_b - b).square().mean() / (b - a).square().mean()) - 2 ** (-2 * bits)) < 0.01
    assert float((got_b - b)[small].square().mean() / (b - a)[small].square().mean()) > 100


def test_the_cli_runs_a_smoke_invocation_and_refuses_an_unknown_rule():
    run = subprocess.run([sys.executable, str(BENCH / "mod_steps.py"), "--rules", "block,sign1,wz,wz-tensor",
                          "--seeds", "0", "--rounds", "1", "--workers", "2", "--mix-weight", "0.4"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [line for line in run.stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [r.split("|")[1].strip() for r in rows] == ["fp32", "block", "sign1", "wz", "wz-tensor"]   # fp32 first
    bad = subprocess.run([sys.executable, str(BENCH / "mod_steps.py"), "--rules", "block,psychic"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "psychic" in bad.stderr and "Traceback" not in bad.stderr
    heavy = subprocess.run([sys.executable, str(BENCH / "mod_steps.py"), "--mix-weight", "0.7"],
                           capture_output=True, text=True, timeout=60)   # more than the pair's mean: no mix
    assert heavy.returncode == 2 and "--mix-weight" in heavy.stderr and "Traceback" not in heavy.stderr
    assert set(RULES) >= {"fp32", "as-built", "block"}
    for args, named in ((["--codec", "mod9"], "mod9"), (["--codec", "mod3-sd", "--rules", "as-built,block"], "block"),
                        (["--mix-momentum", "1.5"], "--mix-momentum")):
        bad = subprocess.run([sys.executable, str(BENCH / "mod_steps.py"), *args], capture_output=True, text=True,
                             timeout=60)
        assert bad.returncode == 2 and named in bad.stderr and "Traceback" not in bad.stderr, args


def test_the_codec_and_mix_momentum_options_reach_the_run_and_fp32_keeps_its_own():
    # five rounds of one pair: past guard.known_after's three accepted mixes, from where the outer momentum may
    # carry a correction, so kappa changes the run; the same run and seed otherwise
    smoke = {"rounds": 5, "workers": 2, "inner.inner_steps": 4}
    # mod3-sd brings kappa 0 (protocol/codec.py MIX_MOMENTUM): --mix-momentum 1 carries its corrections whole
    own = simulate("as-built", 0, smoke, codec="mod3-sd")
    carried = simulate("as-built", 0, smoke, codec="mod3-sd", mix_momentum=1.0)
    assert own["codec"] == carried["codec"] == "mod3-sd"
    assert (own["mix_momentum"], carried["mix_momentum"]) == (None, 1.0)
    assert own["final"] != carried["final"]
    fp32 = simulate("fp32", 0, smoke, codec="mod3-sd", mix_momentum=0.0)
    assert (fp32["codec"], fp32["mix_momentum"]) == ("float32", None)
    # mod4-sd brings its own kappa, 0.5 (protocol/codec.py Codec.mix_momentum): unset reads as 0.5 set, not as 1
    default = simulate("as-built", 0, smoke)["final"]
    assert default == simulate("as-built", 0, smoke, mix_momentum=0.5)["final"]
    assert default != simulate("as-built", 0, smoke, mix_momentum=1.0)["final"]


def test_clock_fp32_gives_the_modulo_rule_fp32s_clock_and_codec_its_own(tmp_path):
    times = {}
    for clock in ("fp32", "codec"):
        out = tmp_path / f"{clock}.json"
        run = subprocess.run([sys.executable, str(BENCH / "mod_steps.py"), "--rules", "as-built", "--seeds", "0",
                              "--rounds", "1", "--workers", "2", "--clock", clock, "--json", str(out)],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        rows = json.loads(out.read_text())["rows"]
        assert {r["clock"] for r in rows} == {clock}
        times[clock] = {r["rule"]: r["sim_time_s"] for r in rows}
    assert times["fp32"]["as-built"] == times["fp32"]["fp32"] == times["codec"]["fp32"]
    assert times["codec"]["as-built"] < times["codec"]["fp32"]    # mod4-sd's own half a byte: shorter exchanges
