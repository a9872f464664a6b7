"""The inner lr's warm-up and decay (peer/train/inner.py lr_at), shared by the live peer and the simulator: golden
values worked out by hand, and the config's one rule."""
import math

import pytest
import torch
from click.testing import CliRunner
from pydantic import ValidationError

from gasloc.cli.main import cli
from gasloc.peer.train.inner import InnerConfig, decay_factor, lr_at, run_inner_phase
from gasloc.peer.train.model import ModelConfig, build_model


def test_no_total_steps_no_decay():
    c = InnerConfig(lr=1e-3, warmup_steps=10)
    assert [lr_at(s, c) for s in (0, 4, 9, 10, 10_000)] == pytest.approx([1e-4, 5e-4, 1e-3, 1e-3, 1e-3])
    assert lr_at(10_000, c) == c.lr  # exactly: no decay multiplies by exactly 1
    assert lr_at(5, InnerConfig(lr=2e-3, warmup_steps=0)) == 2e-3


def test_cosine_from_the_end_of_warmup():
    c = InnerConfig(lr=1e-3, warmup_steps=100, total_steps=1100, min_lr_factor=0.1)
    assert lr_at(99, c) == pytest.approx(1e-3)        # the warm-up's last step: the peak
    assert lr_at(100, c) == pytest.approx(1e-3)       # the decay starts here
    assert lr_at(600, c) == pytest.approx(0.55e-3)    # halfway: 0.1 + 0.9 * (1 + cos(pi/2)) / 2
    assert lr_at(350, c) == pytest.approx(1e-3 * (0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2))
    assert lr_at(1100, c) == pytest.approx(1e-4)
    assert lr_at(5000, c) == pytest.approx(1e-4)      # past the end: stays at the floor


def test_warmup_stable_decay_holds_the_peak_then_decays_linearly():
    c = InnerConfig(lr=2e-3, warmup_steps=50, total_steps=600, decay_ratio=0.2, decay_type="linear",
                    min_lr_factor=0.1)
    assert lr_at(480, c) == pytest.approx(2e-3)       # 600 x 0.8: still the peak
    assert lr_at(540, c) == pytest.approx(2e-3 * 0.55)
    assert lr_at(600, c) == pytest.approx(2e-4)
    assert decay_factor(300, c) == 1.0


def test_a_joiner_warms_up_on_its_own_steps_and_decays_with_the_swarm():
    """A joiner's own count starts at 0 (fresh AdamW state: it warms up), its position is the swarm's."""
    c = InnerConfig(lr=1e-3, warmup_steps=10, total_steps=100, decay_type="linear", min_lr_factor=0.0)
    assert lr_at(0, c, position=55) == pytest.approx(1e-4 * 0.5)    # 1/10 of the warm-up, half-way down the decay
    assert lr_at(0, c, position=0) == pytest.approx(1e-4)
    assert lr_at(20, c, position=100) == 0.0


def test_total_steps_within_the_warmup_is_refused():
    with pytest.raises(ValidationError, match=r"inner.total_steps \(50\) must be larger than inner.warmup_steps"):
        InnerConfig(warmup_steps=50, total_steps=50)
    with pytest.raises(ValidationError):
        InnerConfig(total_steps=100, decay_ratio=0.0)
    with pytest.raises(ValidationError):
        InnerConfig(total_steps=100, decay_type="step")


def test_the_cli_names_the_bad_schedule(tmp_path):
    cfg = tmp_path / "p.toml"
    cfg.write_text("[inner]\nwarmup_steps = 100\ntotal_steps = 40\n")
    for cmd in (["peer"], ["sim"]):
        res = CliRunner().invoke(cli, [*cmd, "--config", str(cfg), "--print-config"])
        assert res.exit_code == 2, res.output
        assert "total_steps (40) must be larger than inner.warmup_steps (100)" in res.output
        assert "Traceback" not in res.output
    cfg.write_text("[inner]\nwarmup_steps = 10\ntotal_steps = 40\ndecay_ratio = 0.5\n")
    res = CliRunner().invoke(cli, ["sim", "--config", str(cfg), "--print-config"])
    assert res.exit_code == 0 and "total_steps = 40" in res.output and "decay_ratio = 0.5" in res.output


def test_the_inner_phase_sets_each_steps_lr_from_step_and_position():
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset="micro", seq_len=8), vocab_size=16)
    c = InnerConfig(lr=1e-3, warmup_steps=4, total_steps=20, decay_type="linear", min_lr_factor=0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=c.lr)
    seen = []
    batch = torch.randint(0, 16, (2, 9))
    steps, _ = run_inner_phase(model, opt, lambda: batch, 2, c.model_copy(update={"inner_steps": 3}),
                               after_step=lambda: seen.append(opt.param_groups[0]["lr"]), start_position=14)
    assert steps == 3
    assert seen == pytest.approx([lr_at(2, c, 14), lr_at(3, c, 15), lr_at(4, c, 16)])
    assert seen == pytest.approx([0.75e-3 * 0.375, 1e-3 * 0.3125, 1e-3 * 0.25])
