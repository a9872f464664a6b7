"""`gasloc sim` (one simulated run) and `gasloc sim compare` (a suite of runs that checks the paper's claims)."""
from __future__ import annotations

import json
import logging
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import click

from gasloc.runtime.config import ConfigError, dump_toml, resolve

ALGORITHMS = ("gasloc", "diloco", "noloco", "gossip", "local")
TOPOLOGIES = ("complete", "random", "ring", "exponential")


def _fail(msg: str, code: int = 2) -> None:
    click.echo(f"Error: {msg}", err=True)
    sys.exit(code)


def _setup_logging() -> None:
    logging.basicConfig(level=os.environ.get("GASLOC_LOG_LEVEL", "WARNING").upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")


@contextmanager
def _progress_bar(label: str):
    """A rich progress bar on stderr (only on a terminal); yields a callback (done, total, sim_s, loss)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("{task.fields[info]}"), console=console, disable=not console.is_terminal,
                   transient=False)
    task = bar.add_task(label, total=None, info="")

    def update(done: int, total: int, sim_s: float, loss: float | None) -> None:
        info = f"sim {sim_s:,.0f}s" + (f" val {loss:.3f}" if loss is not None else "")
        bar.update(task, completed=done, total=total, info=info)

    with bar:
        yield update


def _write(path: str, text: str) -> None:
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
    except OSError as e:
        _fail(f"cannot write {path}: {e.strerror}", 1)


def _opt(*names, **kw):
    return click.option(*names, default=None, show_default=False, **kw)


@click.group(invoke_without_command=True, context_settings={"show_default": True})
@click.option("--config", "config_file", type=click.Path(dir_okay=False), default=None,
              help="TOML config file (sections: model, data, inner, outer, clock).")
@click.option("--print-config", is_flag=True, help="Print the resolved config as TOML and exit.")
@_opt("--algorithm", type=click.Choice(ALGORITHMS), help="Outer update. [default: gasloc]")
@_opt("--form", type=click.Choice(("A", "B", "C")), help="GASLoC form. [default: C]")
@_opt("--workers", type=int, help="K simulated workers. [default: 8]")
@_opt("--topology", type=click.Choice(TOPOLOGIES), help="Who may pair. complete: everyone averages with "
      "everyone, which is DiLoCo exactly when both get the same outer momentum and lr (GASLoC picks its own from H, "
      "DiLoCo keeps 0.9 / 0.7: pass --momentum 0.9 --outer-lr 0.7 to compare). [default: random]")
@_opt("--inner-steps", type=int, help="H inner steps per round. [default: 20]")
@_opt("--rounds", type=int, help="Rounds per worker (on average). [default: 50]")
@_opt("--seed", type=int, help="Seed of init and matchings. [default: 0]")
@_opt("--bandwidth-profile", help="uniform | half-slow-10x | half-slow-compute-2x | log-uniform-3-300 | hetero-bench | a "
      "TOML/JSON file.")
@_opt("--model", "preset", help="Model preset. [default: tiny]")
@_opt("--outer-lr", type=float, help="Outer lr eta. [default: gasloc from H (1.0 for H <= 4, else 0.7); diloco, "
      "noloco 0.7; gossip 1]")
@_opt("--momentum", type=float, help="Outer momentum gamma (NoLoCo: beta). [default: gasloc from H (0.1 for "
      "H <= 4, else 0.7); diloco 0.9; noloco 0.5]")
@_opt("--mix-weight", type=float, help="Weight per partner in the mix. [default: group mean]")
@_opt("--mix-momentum", type=float, help="Form C: share of the mixing correction that outer momentum carries on "
      "(0-1). [default: 1]")
@_opt("--schedule", type=click.Choice(("live", "lockstep", "async")), help="live: each worker runs the live "
      "peer's partner search; lockstep: a shared round counter; async: none. [default: live]")
@_opt("--slower-link-ratio", type=float, help="Schedule live: pass over peers on links this many times slower "
      "for the first half of a search (the live peer's swarm.slower_link_ratio). [default: 0, off]")
@_opt("--num-partners", type=click.IntRange(1, 2), help="Partners per round. [default: 1]")
@click.option("--bandwidth-weighted/--no-bandwidth-weighted", default=None,
              help="Favour pairs on fast links. [default: off]")
@click.option("--guard/--no-guard", default=None,
              help="Robust mixing (guard.enabled): clip or reject far partners, as a live peer does. [default: on]")
@click.option("--batched/--no-batched", default=None,
              help="Batch the workers' inner steps (stacked models, vmap): same maths, faster for many small "
              "workers. [default: off]")
@click.option("--overlap/--no-overlap", default=None,
              help="One-round-delayed mixing: the exchange runs during the next round's inner steps. [default: off]")
@_opt("--inner-lr", type=float, help="AdamW lr. [default: 1e-3]")
@_opt("--warmup-steps", type=int, help="Inner lr warm-up steps. [default: 50]")
@_opt("--batch-size", type=int, help="Sequences per inner step. [default: 4]")
@_opt("--seq-len", type=int, help="Context length. [default: 64]")
@_opt("--time-budget-s", type=float, help="Time-budgeted rounds: virtual seconds of inner steps per round.")
@_opt("--eval-every", type=int, help="Evaluate every N rounds. [default: 5]")
@_opt("--val-batches", type=int, help="Validation batches per evaluation. [default: 2]")
@_opt("--max-sim-time-s", type=float, help="Stop once the virtual clock passes this.")
@_opt("--target-val-loss", type=float, help="Stop once the mean validation loss reaches this.")
@_opt("--seconds-per-step", type=float, help="Virtual seconds per inner step. [default: 0.3]")
@_opt("--bandwidth-mbps", type=float, help="Base link bandwidth, Mbit/s. [default: 1000]")
@_opt("--match-timeout-s", type=float, help="Max wait for a partner before a solo round.")
@click.option("--charge-codec/--no-charge-codec", default=None,
              help="Charge the clock the codec's bytes; --no-charge-codec: clock.bytes_per_param whatever the codec "
              "(with bytes_per_param 4, the fp32 wire's partners: the codec's rounding apart from its bytes). "
              "[default: on]")
@_opt("--threads", type=int, help="torch CPU threads. [default: 1]")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None, help="Write the result here.")
@click.option("--plot", "plot_out", type=click.Path(dir_okay=False), default=None,
              help="Write a PNG of validation loss against simulated time.")
@click.pass_context
def sim(ctx: click.Context, config_file, print_config, json_out, plot_out, **opts) -> None:
    """Simulate K workers of the model on one CPU under a virtual clock.

    Example: gasloc sim --algorithm gasloc --workers 8 --topology ring --inner-steps 20 --rounds 30 --json out.json
    """
    if ctx.invoked_subcommand is not None:
        return
    from gasloc.sim.config import SimConfig

    keys = {"algorithm": "outer.algorithm", "form": "outer.form", "inner_steps": "inner.inner_steps",
            "bandwidth_profile": "clock.profile", "preset": "model.preset", "outer_lr": "outer.outer_lr",
            "momentum": "outer.momentum", "mix_weight": "outer.mix_weight",
            "mix_momentum": "outer.mix_momentum", "overlap": "outer.overlap", "guard": "guard.enabled",
            "inner_lr": "inner.lr",
            "warmup_steps": "inner.warmup_steps", "batch_size": "data.batch_size", "seq_len": "model.seq_len",
            "time_budget_s": "inner.time_budget_s", "val_batches": "data.val_batches",
            "seconds_per_step": "clock.seconds_per_step", "bandwidth_mbps": "clock.bandwidth_mbps",
            "match_timeout_s": "clock.match_timeout_s", "charge_codec": "clock.charge_codec", "slower_link_ratio": "search.slower_link_ratio"}
    try:
        cfg = resolve(SimConfig, config_file, {keys.get(k, k): v for k, v in opts.items()})
    except ConfigError as e:
        _fail(str(e))
    if print_config:
        click.echo(dump_toml(cfg), nl=False)
        return
    _setup_logging()
    from gasloc.sim.runner import run

    try:
        with _progress_bar(f"sim {cfg.outer.algorithm}") as progress:
            result = run(cfg, progress)
    except ConfigError as e:  # a bad profile file is found when the run starts
        _fail(str(e))
    except FloatingPointError as e:
        _fail(str(e), 1)
    if json_out:
        _write(json_out, json.dumps(result, indent=1) + "\n")
    if plot_out:
        from gasloc.sim.plot import plot_run
        plot_run(result, plot_out)
    e = result["evals"][-1]
    topology = "all-reduce" if cfg.barrier else cfg.topology
    click.echo(f"{cfg.outer.algorithm} topology={topology} workers={cfg.workers} final_val_loss="
               f"{e['val_loss_mean']:.4f} avg_model={e['val_loss_avg_model']:.4f} consensus={e['consensus']:.4g} "
               f"sim_time_s={e['sim_time_s']:.1f} tokens={e['tokens']} stopped_by={result['stopped_by']}")


# the suites of sim/suite.py and sim/scale.py, named here so that the CLI starts without importing them (a unit test
# keeps the two lists equal)
SUITE_NAMES = ("paper", "paper-cosine", "smoke", "overlap", "overlap-smoke", "hetero", "hetero-smoke", "scale",
               "scale-smoke", "tune-h1", "tune-h1-smoke", "tune-h20", "tune-h20-smoke", "tune-h20-mix", "decay-h20",
               "decay-h20-smoke", "codecs", "codecs-c", "codecs-smoke")


@sim.command()
@click.option("--suite", type=click.Choice(SUITE_NAMES),
              default="paper", show_default=True, help="paper: the paper's claims at 8 workers (~10 min on 2 "
              "cores); paper-cosine: the same with the inner lr decayed over each claim's length; overlap: "
              "delayed mixing against plain mixing (~5 min); hetero: bench/hetero.py's setup, the "
              "simulator's time ratios beside the bench's (~5 min); scale: GASLoC against DiLoCo at 8-1,000 "
              "workers of the micro preset, uniform and log-uniform 3-300 Mbit links; tune-h1: the H = 1 sweep "
              "behind GASLoC's H-aware outer defaults (~5 min); tune-h20: the H = 20 sweep against DiLoCo (~8 min); "
              "tune-h20-mix: claim (b)'s GASLoC with one change each (~10 min); decay-h20: claim (b) under "
              "decaying inner-lr schedules (~10 min); codecs: claim (b)'s GASLoC per wire codec and seed against the "
              "fp32 wire (~25 min); codecs-c: claim (c) per codec; *-smoke: a seconds-long check of the same.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None, help="Write every run here.")
@click.option("--plot", "plot_out", type=click.Path(dir_okay=False), default=None,
              help="Write a PNG of validation loss against simulated time.")
@click.option("--markdown", "md_out", type=click.Path(dir_okay=False), default=None,
              help="Also write the markdown table here.")
@click.option("--jobs", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Runs in parallel (one process and one torch thread each).")
@click.option("--only", default=None, metavar="PATTERNS", help="Only the runs whose names match one of these "
              "comma-separated shell patterns (and the runs they derive from), e.g. 'float32-*,int4-sd-*'; claims "
              "that read a run left out say so.")
def compare(suite: str, json_out, plot_out, md_out, jobs: int, only: str | None) -> None:
    """Run a suite of simulations and print a markdown table with PASS/FAIL per claim."""
    _setup_logging()
    from gasloc.sim.scale import SCALE_SUITES
    from gasloc.sim.suite import SUITES, markdown, run_suite

    with _progress_bar(f"suite {suite}") as progress:
        try:
            report = run_suite({**SUITES, **SCALE_SUITES}[suite], jobs=jobs, progress=progress,
                               only=only.split(",") if only else None)
        except FloatingPointError as e:
            _fail(str(e), 1)
        except ValueError as e:   # --only matched nothing
            _fail(str(e), 2)
    table = markdown(report)
    click.echo(table, nl=False)
    if md_out:
        _write(md_out, table)
    if json_out:
        _write(json_out, json.dumps(report, indent=1) + "\n")
    if plot_out:
        from gasloc.sim.plot import plot_scale, plot_suite
        (plot_scale if suite.startswith("scale") else plot_suite)(report, plot_out)
