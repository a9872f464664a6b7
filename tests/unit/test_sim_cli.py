"""`gasloc sim` and `gasloc sim compare` through click: errors are one line with exit code 2; outputs exist."""
import json

import pytest
from click.testing import CliRunner

from gasloc.cli.main import cli

PNG = b"\x89PNG\r\n\x1a\n"  # the first bytes of every PNG

TOY = ["--workers", "2", "--rounds", "2", "--inner-steps", "2", "--seq-len", "32", "--batch-size", "2",
       "--val-batches", "1", "--eval-every", "1"]


def invoke(*args):
    return CliRunner().invoke(cli, ["sim", *args])


def one_line_error(res, needle):
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.startswith("Error:")]
    assert len(lines) == 1 and needle in lines[0], res.output
    assert "Traceback" not in res.output


@pytest.mark.parametrize("args,needle", [
    (["--algorithm", "sgd"], "'sgd' is not one of"),
    (["--num-partners", "3"], "--num-partners"),
    (["--workers", "0"], "bad value for 'workers'"),
    (["--workers", "1", "--algorithm", "gasloc"], "needs at least 2 workers"),
    (["--algorithm", "gossip", "--momentum", "0.5"], "gossip"),
    (["--model", "huge"], "unknown preset 'huge'"),
    (["--overlap", "--schedule", "async"], "lockstep schedule only"),
    (["--overlap", "--algorithm", "diloco"], "defined for gasloc and gossip"),
])
def test_bad_flags(args, needle):
    one_line_error(invoke(*args), needle)


def test_bad_profile_file(tmp_path):
    p = tmp_path / "links.toml"
    p.write_text("[[workers]]\nbandwidth_mbps = 100\n")
    one_line_error(invoke(*TOY, "--bandwidth-profile", str(p)), "lists 1 worker(s) but the simulation has 2")
    one_line_error(invoke(*TOY, "--bandwidth-profile", str(tmp_path / "none.toml")), "does not exist")


def test_bad_config_file(tmp_path):
    p = tmp_path / "sim.toml"
    p.write_text("[clock]\nbandwith_mbps = 10\n")
    one_line_error(invoke("--config", str(p)), "unknown key 'clock.bandwith_mbps'")


def test_print_config_resolves_file_and_flags(tmp_path):
    p = tmp_path / "sim.toml"
    p.write_text("workers = 6\n[outer]\nmomentum = 0.5\n")
    res = invoke("--config", str(p), "--print-config", "--inner-lr", "0.004", "--bandwidth-profile", "half-slow-10x")
    assert res.exit_code == 0, res.output
    assert "workers = 6" in res.output and "momentum = 0.5" in res.output and "lr = 0.004" in res.output
    assert 'profile = "half-slow-10x"' in res.output


@pytest.mark.timeout(60)
def test_run_writes_json_and_plot(tmp_path):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    res = invoke(*TOY, "--algorithm", "gasloc", "--topology", "ring", "--json", str(out), "--plot", str(png))
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    assert r["config"]["topology"] == "ring" and len(r["evals"]) == 3
    assert png.read_bytes()[:8] == PNG
    assert "final_val_loss=" in res.output



def compare(tmp_path, suite: str, *, plot: bool = True) -> tuple[str, dict]:
    """`gasloc sim compare --suite SUITE --json --plot`: its output and report; the PNG checked to be one."""
    out, png = tmp_path / f"{suite}.json", tmp_path / f"{suite}.png"
    res = CliRunner().invoke(cli, ["sim", "compare", "--suite", suite, "--json", str(out),
                                   *(["--plot", str(png)] if plot else [])])
    assert res.exit_code == 0, res.output
    if plot:
        assert png.read_bytes()[:8] == PNG
    return res.output, json.loads(out.read_text())


@pytest.mark.timeout(120)
def test_compare_smoke_suite(tmp_path):
    out, png, md = tmp_path / "s.json", tmp_path / "s.png", tmp_path / "s.md"
    res = CliRunner().invoke(cli, ["sim", "compare", "--suite", "smoke", "--json", str(out), "--plot", str(png),
                                   "--markdown", str(md)])
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    assert list(report["runs"]) == ["a-ring-gasloc", "a-ring-gossip", "a-ring-noloco", "a-random-gasloc",
                                    "a-random-gossip", "a-random-noloco", "b-gasloc", "b-diloco", "c-diloco",
                                    "c-gasloc", "c-diloco-mm", "c-gasloc-mm"]
    assert [c["claim"] for c in report["claims"]] == ["a-ring", "a-random", "b", "c", "c-mm"]
    # claim c-mm's DiLoCo runs hivemind's matchmaking keyed by epoch (sim/groups.py): its groups are reported
    assert report["runs"]["c-diloco-mm"]["search"]["allreduce_groups"]
    # claim c's GASLoC run stops at DiLoCo's final loss or DiLoCo's wall-clock, whichever comes first
    c_g, c_d = report["runs"]["c-gasloc"], report["runs"]["c-diloco"]
    assert c_g["config"]["target_val_loss"] == c_d["final_val_loss"]
    assert c_g["config"]["max_sim_time_s"] == c_d["final_sim_time_s"]
    assert c_g["stopped_by"] in ("target_val_loss", "max_sim_time", "rounds")
    table = md.read_text()
    assert table == res.output
    assert table.count("| **PASS** |") + table.count("| **FAIL** |") == 5
    for name in report["runs"]:
        assert f"| {name} |" in table
    assert png.read_bytes()[:8] == PNG


@pytest.mark.timeout(120)
def test_compare_overlap_smoke_suite(tmp_path):
    output, report = compare(tmp_path, "overlap-smoke")
    runs = report["runs"]
    assert list(runs) == ["uniform-plain", "uniform-overlap", "half-slow-10x-plain", "half-slow-10x-overlap"]
    assert [runs[n]["config"]["outer"]["overlap"] for n in runs] == [False, True, False, True]
    # same tokens, and the overlapped exchanges cost no simulated time while they hide behind the inner steps
    for prof in ("uniform", "half-slow-10x"):
        plain, over = runs[f"{prof}-plain"], runs[f"{prof}-overlap"]
        assert plain["tokens"] == over["tokens"]
        assert over["final_sim_time_s"] < plain["final_sim_time_s"]
    assert [c["claim"] for c in report["claims"]] == ["loss-uniform", "speed-uniform", "loss-half-slow-10x",
                                                      "speed-half-slow-10x"]
    assert "gasloc (C), overlap" in output


@pytest.mark.timeout(180)
def test_compare_hetero_smoke_suite_puts_the_bench_ratios_beside_the_simulators(tmp_path):
    _, report = compare(tmp_path, "hetero-smoke", plot=False)
    runs = report["runs"]
    assert list(runs) == ["gasloc-bw-s0", "gasloc-s0", "diloco-s0"]
    bw = runs["gasloc-bw-s0"]
    assert bw["config"]["schedule"] == "live" and bw["config"]["search"]["slower_link_ratio"] == 3.0
    assert [x["bandwidth_mbps"] for x in bw["links"]] == [30.0, 3.0] * 3
    assert set(bw["pairs_by_links"]) <= {"3/3", "3/30", "30/30"} and sum(bw["pairs_by_links"].values()) > 0
    # DiLoCo runs hivemind's matchmaking as the live peer does (sim/groups.py): its groups are reported
    groups = runs["diloco-s0"]["search"]["allreduce_groups"]
    assert groups and all(2 <= int(n) <= 6 for n in groups)
    assert [c["claim"] for c in report["claims"]] == ["bench-bw", "bench-uniform"]
    for c in report["claims"]:
        assert "vs bench 0." in c["numbers"]


@pytest.mark.timeout(180)
def test_compare_scale_smoke_suite_reports_consensus_and_paired_share(tmp_path):
    _, report = compare(tmp_path, "scale-smoke")
    assert [c["claim"] for c in report["claims"]] == ["k4-uniform", "k4-log-uniform-3-300", "k8-uniform",
                                                      "k8-log-uniform-3-300"]
    bw = [x["bandwidth_mbps"] for x in report["runs"]["k8-log-uniform-3-300-gasloc"]["links"]]
    assert 3 <= min(bw) < max(bw) <= 300 and len(set(bw)) == 8
    for c in report["claims"]:
        assert "consensus" in c["numbers"] and "% of rounds paired" in c["numbers"]
    assert report["runs"]["k8-uniform-gasloc"]["config"]["model"]["preset"] == "micro"


@pytest.mark.timeout(180)
def test_compare_tune_h1_smoke_suite_runs_gossip_beside_each_setting(tmp_path):
    output, report = compare(tmp_path, "tune-h1-smoke")  # a sweep: its plot has one panel with every run
    assert list(report["runs"]) == ["ring-gossip", "ring-g0.1-e0.9", "random-gossip", "random-g0.1-e0.9"]
    outer = report["runs"]["ring-g0.1-e0.9"]["config"]["outer"]
    assert (outer["momentum"], outer["outer_lr"]) == (0.1, 0.9)  # set explicitly by the suite
    assert report["claims"] == [] and "ring-gossip" in output
    assert report["timing"]["runs"]["ring-gossip"]["peak_rss_mb"] > 0


def test_batched_flag_reaches_the_config():
    res = CliRunner().invoke(cli, ["sim", "--batched", "--print-config"])
    assert res.exit_code == 0, res.output
    assert "batched = true" in res.output


def test_charge_codec_flag_reaches_the_clock_config():
    for flag, value in (("--no-charge-codec", "false"), ("--charge-codec", "true")):
        res = CliRunner().invoke(cli, ["sim", flag, "--print-config"])
        assert res.exit_code == 0, res.output
        clock = res.output.split("[clock]")[1].split("\n[")[0]
        assert f"charge_codec = {value}" in clock


def test_tune_h20_suite_sweeps_gasloc_against_diloco_on_claim_bs_setup():
    # the suite's plumbing is tune-h1-smoke's (run above); here its runs resolve to what docs/sim-results.md says
    from gasloc.sim.suite import SUITES, _config
    suite = SUITES["tune-h20"]
    cfgs = {s.name: _config(suite, s) for s in suite.runs}
    assert cfgs["diloco"].barrier and cfgs["diloco"].outer.algorithm == "diloco"
    for name, c in cfgs.items():
        assert (c.inner.inner_steps, c.rounds, c.inner.lr, c.schedule) == (20, 30, 2e-3, "live"), name
    assert (cfgs["g0.7-e0.5"].outer.momentum, cfgs["g0.7-e0.5"].outer.outer_lr) == (0.7, 0.5)
    assert cfgs["g0.7-e0.5"].guard.enabled and not cfgs["default-noguard"].guard.enabled
    assert cfgs["default-noguard"].topology == "random"


def test_tune_h20_mix_suite_changes_one_thing_per_gasloc_run():
    from gasloc.sim.suite import SUITES, _config
    suite = SUITES["tune-h20-mix"]
    cfgs = {s.name: _config(suite, s) for s in suite.runs}
    for name, c in cfgs.items():
        assert (c.inner.inner_steps, c.rounds, c.schedule) == (20, 30, "live"), name
        assert c.inner.lr == (1e-3 if name == "lr1e-3" else 2e-3), name
    d, b, k = cfgs["default"].outer, cfgs["form-B"].outer, cfgs["g0.9-e0.5-k0.5"].outer
    assert (d.form, d.gamma, d.eta, d.kappa) == ("C", 0.7, 0.7, 1.0)
    assert (b.form, b.gamma, b.eta) == ("B", 0.7, 0.7)
    assert (k.gamma, k.eta, k.mix_momentum) == (0.9, 0.5, 0.5)
    assert cfgs["lr1e-3"].outer == cfgs["default"].outer and cfgs["default"].topology == "random"


def test_every_suite_is_a_choice_of_compare():
    from gasloc.sim.cli import SUITE_NAMES
    from gasloc.sim.scale import SCALE_SUITES
    from gasloc.sim.suite import SUITES
    assert sorted(SUITE_NAMES) == sorted({**SUITES, **SCALE_SUITES})


def test_decay_h20_suite_gives_both_methods_each_schedule():
    from gasloc.sim.suite import SUITES, _config
    suite = SUITES["decay-h20"]
    cfgs = {s.name: _config(suite, s) for s in suite.runs}
    for name, c in cfgs.items():
        assert (c.inner.inner_steps, c.rounds, c.schedule, c.workers) == (20, 30, "live", 8), name
        assert c.inner.lr == (1e-3 if name.endswith("lr0.001") else 2e-3), name
    assert cfgs["constant-gasloc"].inner.total_steps is None and cfgs["constant-diloco"].inner.total_steps is None
    for sched, ratio, kind in (("wsd", 0.2, "linear"), ("cosine", 1.0, "cosine")):
        for run in (f"{sched}-diloco", f"{sched}-gasloc", f"{sched}-diloco-lr0.001"):
            i = cfgs[run].inner
            assert (i.total_steps, i.decay_ratio, i.decay_type, i.min_lr_factor) == (600, ratio, kind, 0.1), run
    assert cfgs["cosine-gasloc"].outer.algorithm == "gasloc" and cfgs["cosine-gasloc"].topology == "random"
    assert [c.name for c in suite.claims] == ["b-constant", "b-wsd", "b-cosine"]


@pytest.mark.timeout(180)
def test_compare_decay_smoke_suite_checks_claim_b_per_schedule(tmp_path):
    _, report = compare(tmp_path, "decay-h20-smoke")
    assert list(report["runs"]) == ["constant-diloco", "constant-gasloc", "cosine-diloco", "cosine-gasloc"]
    assert [c["claim"] for c in report["claims"]] == ["b-constant", "b-cosine"]
    # the decay reached the runs: the same start, a lower lr at the end, so different final losses
    const, cos = report["runs"]["constant-diloco"], report["runs"]["cosine-diloco"]
    assert cos["config"]["inner"]["total_steps"] == 6
    assert cos["evals"][0]["val_loss_mean"] == const["evals"][0]["val_loss_mean"]
    assert cos["final_val_loss"] != const["final_val_loss"]


def test_claim_b_fails_and_says_so_when_the_token_counts_differ():
    """The live schedule ends with some workers' rounds in flight: GASLoC may have spent more tokens than DiLoCo.
    More than 1% more fails the claim whatever the losses, and the numbers say why."""
    from gasloc.sim.suite import claim_within
    check = claim_within(0.02, "g", "d")
    run = lambda loss, tokens: {"final_val_loss": loss, "tokens": tokens}  # noqa: E731
    ok, text = check({"g": run(1.01, 1_000_000), "d": run(1.0, 1_000_000)})
    assert ok and "+1.00%" in text and "differ" not in text
    ok, text = check({"g": run(1.01, 1_017_000), "d": run(1.0, 1_000_000)})
    assert not ok and "token counts differ by more than 1%" in text
    ok, text = check({"g": run(1.03, 1_000_000), "d": run(1.0, 1_000_000)})
    assert not ok and "+3.00% (limit +2%)" in text


@pytest.mark.timeout(120)
def test_compare_codecs_smoke_suite_and_only_a_part_of_it(tmp_path):
    """The codecs suite charges each codec's bytes and checks each against the fp32 wire, paired by seed; --only
    runs a part of a suite, and a claim that reads a run left out says 'not run' instead of failing."""
    out = tmp_path / "c.json"
    res = CliRunner().invoke(cli, ["sim", "compare", "--suite", "codecs-smoke", "--json", str(out)])
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    assert list(report["runs"]) == ["float32-s0", "int4-s0", "int8-p10-s0", "c-diloco", "c-gasloc-float32",
                                    "c-gasloc-int4", "c-gasloc-int8-p10"]
    sent = {n: sum(r["bytes_sent_per_worker"]) for n, r in report["runs"].items()}
    assert sent["int4-s0"] < sent["float32-s0"] / 6 and sent["int8-p10-s0"] < sent["float32-s0"] / 30, sent
    assert [c["claim"] for c in report["claims"]] == ["int4", "int8-p10", "c-float32", "c-int4", "c-int8-p10"]
    assert all(c["passed"] is not None for c in report["claims"])
    res = CliRunner().invoke(cli, ["sim", "compare", "--suite", "codecs-smoke", "--only", "int4-*"])
    assert res.exit_code == 0, res.output
    assert "| int4-s0 |" in res.output and "| float32-s0 |" not in res.output
    assert res.output.count("| not run |") == 5
    one_line_error(CliRunner().invoke(cli, ["sim", "compare", "--suite", "codecs-smoke", "--only", "nope*"]),
                   "matches no run")
