"""GASLoC's outer settings follow H when the user leaves them unset; DiLoCo keeps its published ones."""
import pytest
from click.testing import CliRunner

from gasloc.peer.config import PeerConfig
from gasloc.peer.train.outer import H_DEFAULTS, OuterConfig, fit_to_h
from gasloc.runtime.config import resolve
from gasloc.sim.cli import sim
from gasloc.sim.config import SimConfig


@pytest.mark.parametrize("h,gamma,eta", [(1, 0.1, 1.0), (4, 0.1, 1.0), (5, 0.7, 0.7), (20, 0.7, 0.7),
                                         (500, 0.7, 0.7)])
def test_gasloc_picks_from_the_table(h, gamma, eta):
    for model in (SimConfig, PeerConfig):
        c = resolve(model, flags={"inner.inner_steps": h}, environ={})
        assert (c.outer.gamma, c.outer.eta) == (gamma, eta), model
        assert f"H = {h}" in c.outer._picked


def test_the_table_covers_every_h_in_order():
    tops = [row[0] for row in H_DEFAULTS]
    assert tops == sorted(tops) and tops[-1] >= 10**9


def test_what_the_user_sets_is_kept_and_only_the_rest_is_picked():
    c = resolve(SimConfig, flags={"inner.inner_steps": 1, "outer.momentum": 0.5}, environ={})
    assert (c.outer.gamma, c.outer.eta) == (0.5, 1.0)
    assert "momentum =" not in c.outer._picked and "outer_lr = 1.0" in c.outer._picked
    both = resolve(SimConfig, flags={"inner.inner_steps": 1, "outer.momentum": 0.5, "outer.outer_lr": 0.6},
                   environ={})
    assert (both.outer.gamma, both.outer.eta) == (0.5, 0.6) and both.outer._picked is None


@pytest.mark.parametrize("algorithm,gamma,eta", [("diloco", 0.9, 0.7), ("noloco", 0.5, 0.7), ("gossip", 0.0, 1.0)])
def test_baselines_keep_their_published_defaults_at_any_h(algorithm, gamma, eta):
    for h in (1, 20):
        c = resolve(SimConfig, flags={"inner.inner_steps": h, "outer.algorithm": algorithm}, environ={})
        assert (c.outer.gamma, c.outer.eta) == (gamma, eta)
        assert fit_to_h(OuterConfig(algorithm=algorithm), h) == OuterConfig(algorithm=algorithm)


def test_print_config_shows_what_was_picked_and_why_and_reads_back_the_same():
    out = CliRunner().invoke(sim, ["--inner-steps", "1", "--print-config"])
    assert out.exit_code == 0, out.output
    outer = out.output.split("[outer]")[1].split("\n\n")[0]
    assert "# momentum = 0.1 and outer_lr = 1.0 picked for H = 1" in outer and "docs/sim-results.md" in outer
    assert "momentum = 0.1\n" in outer and "outer_lr = 1.0\n" in outer


def test_sim_help_says_complete_equals_diloco_at_equal_momentum():
    out = CliRunner().invoke(sim, ["--help"], terminal_width=200)
    assert "DiLoCo exactly when both get the same outer momentum" in " ".join(out.output.split())
