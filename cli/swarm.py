"""`gasloc swarm`: the local demo. One bootstrap and N peers as child processes on loopback (the tiny model and the
embedded corpus by default, one data shard per peer), a live table fed by each peer's metrics.jsonl, and at the end
a summary, summary.json and swarm.png (loss against time per peer). Nothing is left running afterwards.

Run dir: bootstrap.maddrs, bootstrap.log, bootstrap.key, peer-<i>/{metrics.jsonl, peer.log, ...}, swarm.png,
summary.json, status.log (the live status page, `gasloc status --serve`, whose address is printed). Exit code: 0,
or 1 if a peer failed to start, crashed or did not stop cleanly (2: bad options).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
import tomllib
from pathlib import Path
from typing import Literal

import click
from pydantic import BaseModel, ConfigDict, Field, field_validator

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


class SwarmRunConfig(BaseModel):
    """A local swarm for a demo or a smoke test."""
    model_config = ConfigDict(extra="forbid")

    peers: int = Field(4, ge=1, le=32, description="how many peers to start")
    duration_s: float = Field(120.0, ge=0, description="stop after this many seconds (0: until Ctrl+C)")
    run_dir: Path | None = Field(None, description="everything goes here; must be new or empty; unset: "
                                 "runs/swarm-<date>-<time>")
    run_id: str = Field("swarm", description="the run's DHT key prefix")
    algorithm: Literal["gasloc", "gossip", "diloco"] = Field("gasloc", description="outer update of every peer")
    peer_config: Path | None = Field(None, description="TOML config given to every peer (--config); the swarm "
                                     "still sets run id, addresses, run dir and data shard")
    key_path: Path | None = Field(None, description="swarm key file (gasloc keygen FILE): a private swarm, the "
                                  "bootstrap and every peer get it")
    ready_timeout_s: float = Field(180.0, gt=0, description="how long a peer may take to print READY")
    stop_grace_s: float = Field(30.0, gt=0, description="after SIGTERM, how long a peer may take to exit")
    refresh_s: float = Field(1.0, gt=0, description="table refresh period")
    status_port: int | None = Field(0, ge=0, le=65535, description="serve the swarm's live status page "
                                    "(gasloc status --serve) on this port of 127.0.0.1 (0: any free port; the "
                                    "address is printed); unset (null): no page")

    @field_validator("peer_config")
    @classmethod
    def _exists(cls, v: Path | None) -> Path | None:
        if v is not None and not v.is_file():
            raise ValueError(f"peer config {v} is not a file")
        return v

    @field_validator("key_path")
    @classmethod
    def _key_readable(cls, v: Path | None) -> Path | None:
        if v is not None:
            from gasloc.peer.swarm.swarmkey import load_swarm_key
            load_swarm_key(v)     # SwarmKeyError is a ValueError: one line, before anything starts
            return v.resolve()
        return v


class SwarmError(RuntimeError):
    """A failure to report in one line."""


def peer_env(i: int, n: int) -> dict[str, str]:
    """Each peer trains on its own shard; GASLOC_* variables of the caller pass through to every peer."""
    env = dict(os.environ)
    env["GASLOC_DATA__SHARD_INDEX"], env["GASLOC_DATA__NUM_SHARDS"] = str(i), str(n)
    # share the cores instead of each peer starting one thread per core
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
    return env


def _sets_initial_group(env: dict[str, str], peer_config: Path | None) -> bool:
    """Whether the caller chose diloco.initial_group_size (environment or the peers' config file) already."""
    if "GASLOC_DILOCO__INITIAL_GROUP_SIZE" in env:
        return True
    if peer_config is None:
        return False
    try:
        return "initial_group_size" in tomllib.loads(peer_config.read_text()).get("diloco", {})
    except (OSError, tomllib.TOMLDecodeError):
        return True  # the peers will report the file's problem; leave their settings alone


def bootstrap_env() -> dict[str, str]:
    """The caller's GASLOC_* variables (and GASLOC_CONFIG) are meant for the peers: a bootstrap would reject them.
    Only the log level passes."""
    return {k: v for k, v in os.environ.items() if not k.startswith("GASLOC_") or k == "GASLOC_LOG_LEVEL"}


def run(cfg: SwarmRunConfig, peer_args: tuple[str, ...] = ()) -> int:
    from rich.console import Console
    from rich.live import Live

    from gasloc.cli.swarmview import JsonlTail, PeerView, live_table, plot_losses, summary_dict, summary_table
    from gasloc.runtime.procs import ChildFailed, StopSignals, Supervisor, gasloc_argv

    run_dir = cfg.run_dir or Path("runs") / time.strftime("swarm-%Y%m%d-%H%M%S")
    if run_dir.exists() and any(run_dir.iterdir()):
        raise SwarmError(f"run dir {run_dir} is not empty (peers would resume and append to old files); pass a "
                         f"new --run-dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    run_dir = run_dir.resolve()
    console = Console(soft_wrap=True)
    if not console.is_terminal:  # a log file or a pipe: wide enough that the tables do not wrap
        console = Console(soft_wrap=True, width=140)
    stop, signals = threading.Event(), StopSignals()
    sup = Supervisor()

    def on_signal(signum, _frame):
        stop.set()
        if signals.classify() == "force":  # second Ctrl+C: no more waiting for clean shutdowns
            for name in list(sup.children):
                sup.signal_tree(name, signal.SIGKILL)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    names = [f"peer-{i}" for i in range(cfg.peers)]
    views = [PeerView(n) for n in names]
    tails = [JsonlTail(run_dir / n / "metrics.jsonl") for n in names]
    title = f"gasloc swarm: {cfg.peers} peers, {cfg.algorithm}, {run_dir}"
    failed: list[str] = []
    all_ready = False
    t0 = time.time()
    key_args = ("--swarm-key", str(cfg.key_path)) if cfg.key_path is not None else ()
    try:
        boot = sup.start("bootstrap", gasloc_argv(
            "bootstrap", "--host-maddrs", LOOPBACK, "--identity-path", str(run_dir / "bootstrap.key"),
            "--maddrs-file", str(run_dir / "bootstrap.maddrs"), "--run-id", cfg.run_id, "--log-interval-s", "10",
            *key_args),
            run_dir / "bootstrap.log", env=bootstrap_env())
        if sup.wait_ready(boot, 60, cancel=stop) is None:
            return 130
        console.print(f"bootstrap {boot.peer_id} at {boot.maddrs[0]}")
        for i, name in enumerate(names):
            argv = ["peer", *[a for m in boot.maddrs for a in ("--initial-peers", m)], "--run-id", cfg.run_id,
                    "--run-dir", str(run_dir / name), "--algorithm", cfg.algorithm, "--host-maddrs", LOOPBACK,
                    *key_args]
            if cfg.peer_config is not None:
                argv += ["--config", str(cfg.peer_config.resolve())]
            env = peer_env(i, cfg.peers)
            if cfg.algorithm == "diloco" and not _sets_initial_group(env, cfg.peer_config):
                # DiLoCo's start barrier: the first step is all of the peers started here (peer/swarm/diloco.py)
                env["GASLOC_DILOCO__INITIAL_GROUP_SIZE"] = str(cfg.peers)
            sup.start(name, gasloc_argv(*argv, *peer_args), run_dir / name / "peer.log", env=env)
        deadline = time.monotonic() + cfg.ready_timeout_s
        for view in views:
            ready = sup.wait_ready(sup.children[view.name], max(1.0, deadline - time.monotonic()), cancel=stop)
            if ready is None:
                return 130
            view.peer_id, view.status = ready["peer_id"], "running"
        all_ready = True
        console.print(f"{cfg.peers} peers ready in {time.time() - t0:.1f} s; logs and metrics in {run_dir}")
        # the page is an extra: the swarm neither waits for it nor fails with it (its address is printed once it
        # serves its first listing)
        page = sup.start("status", gasloc_argv(
            "status", "--initial-peers", boot.maddrs[0], "--run-id", cfg.run_id, "--serve", str(cfg.status_port)),
            run_dir / "status.log", env=bootstrap_env()) if cfg.status_port is not None else None

        t0 = time.time()  # the table's clock starts when training does
        end = time.monotonic() + cfg.duration_s if cfg.duration_s else None
        last_line = 0.0
        with Live(live_table(views, 0, title), console=console, refresh_per_second=2, transient=False) as live:
            while not stop.is_set() and (end is None or time.monotonic() < end):
                if page is not None and _page_address(page, console):
                    page = None
                _refresh(views, tails, sup)
                live.update(live_table(views, time.time() - t0, title))
                if not console.is_terminal and time.monotonic() - last_line > 10:  # a log, not a screen
                    last_line = time.monotonic()
                    console.print(" ".join(f"{v.name}:r{v.round}" for v in views), f"t={time.time() - t0:.0f}s")
                if all(v.status.startswith("exited") for v in views):
                    break
                stop.wait(cfg.refresh_s)
        console.print()
        failed += [v.name for v in views if v.status.startswith("exited") and v.status != "exited 0"]
    except ChildFailed as e:
        console.print(f"[red]Error:[/red] {e}")
        failed.append(str(e).split(" ", 1)[0])
    finally:
        console.print("stopping...")
        # the peers and the page at once (the page only reads), then the bootstrap: the peers withdraw their records
        # through it
        codes = sup.stop_all(cfg.stop_grace_s, names=[n for n in [*names, "status"] if n in sup.children])
        boot_code = sup.stop("bootstrap", cfg.stop_grace_s) if "bootstrap" in sup.children else 0
        left = sup.cleanup()
    for v in views:
        if v.name in codes and not v.status.startswith("exited"):
            v.status = "stopped" if codes[v.name] == 0 else f"stop failed ({codes[v.name]})"
            if codes[v.name] != 0:
                failed.append(v.name)
    _refresh(views, tails, sup)  # the records written while shutting down
    console.print(summary_table(views))
    import json

    (run_dir / "summary.json").write_text(json.dumps(
        {"peers": summary_dict(views), "failed": sorted(set(failed)), "bootstrap_exit": boot_code,
         "duration_s": time.time() - t0}, indent=1))
    if all_ready:
        plot_losses(views, run_dir / "swarm.png", title)
        console.print(f"loss plot: {run_dir / 'swarm.png'}")
    if left.processes:
        console.print(f"[red]processes had to be killed after stopping:[/red] {left.processes}")
        failed.append("leftover processes")
    if failed:
        console.print(f"[red]failed:[/red] {', '.join(sorted(set(failed)))} (see their logs in {run_dir})")
        return 1
    return 0 if all_ready or signals.first_at is None else 130


def _page_address(page, console) -> bool:
    """Print the status page's address once it is up (or say it is not coming); True when there is nothing more to
    wait for."""
    from gasloc.runtime.procs import parse_ready

    try:
        lines = page.stdout_path.read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    for line in lines:
        ready = parse_ready(line)
        if ready is not None:
            console.print(f"live status page: {ready['url']}")
            return True
    if page.poll() is not None:
        console.print(f"[yellow]the status page exited ({page.poll()}); see {page.log_path}[/yellow]")
        return True
    return False


def _refresh(views, tails, sup) -> None:
    for view, tail in zip(views, tails):
        for rec in tail.read():
            view.update(rec)
        child = sup.children.get(view.name)
        if child is not None and view.status in ("starting", "running"):
            rc = child.poll()
            if rc is not None:
                view.status = f"exited {rc}"


@click.command(context_settings={"ignore_unknown_options": False})
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="TOML with swarm keys")
@click.option("--print-config", is_flag=True, help="print the resolved config as TOML and exit")
@click.option("--peers", type=int, help="number of peers [4]")
@click.option("--duration", "duration_s", type=float, help="seconds to run, 0 for until Ctrl+C [120]")
@click.option("--run-dir", type=click.Path(file_okay=False), help="new or empty directory for everything")
@click.option("--run-id", help="run id of the swarm [swarm]")
@click.option("--algorithm", type=click.Choice(["gasloc", "gossip", "diloco"]), help="outer update [gasloc]")
@click.option("--peer-config", type=click.Path(dir_okay=False), help="TOML config for every peer")
@click.option("--status-port", type=int, help="port of the live status page on 127.0.0.1 (0: any free) [0]")
@click.option("--swarm-key", "key_path", type=click.Path(dir_okay=False), help="swarm key file of a private "
              "swarm, given to the bootstrap and every peer")
@click.argument("peer_args", nargs=-1, type=click.UNPROCESSED)
def swarm(config_file, print_config, peer_args, **flags) -> None:
    """Start a bootstrap and N peers on loopback, show a live table, then a summary and swarm.png.

    Arguments after `--` go to every `gasloc peer`, e.g. `gasloc swarm --peers 2 -- --max-rounds 20`.
    GASLOC_* environment variables are passed to the peers (the swarm itself reads none)."""
    from gasloc.runtime.config import resolve_for_cli
    from gasloc.runtime.logs import setup_logging

    cfg = resolve_for_cli(SwarmRunConfig, config_file, flags, print_config, environ={})
    setup_logging(os.environ.get("GASLOC_LOG_LEVEL", "WARNING"))
    try:
        sys.exit(run(cfg, peer_args))
    except SwarmError as e:
        click.echo(f"Error: {e}", err=True)
        sys.exit(2)
