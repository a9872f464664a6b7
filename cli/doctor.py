"""`gasloc doctor`: can this machine join (or host) a swarm? Runs every check of cli/doctor_checks.py, prints a
table with OK / WARN / FAIL / SKIP and a concrete fix for each problem, and exits 1 if anything FAILed."""
from __future__ import annotations

import sys
from pathlib import Path

import click
from pydantic import BaseModel, ConfigDict, Field, field_validator


class DoctorConfig(BaseModel):
    """What to check: the settings the peer (or bootstrap node) will run with."""
    model_config = ConfigDict(extra="forbid")

    initial_peers: list[str] = Field(default_factory=list, description="peers or bootstrap nodes to try "
                                     "(multiaddrs or files of them), as given to gasloc peer")
    port: int = Field(0, ge=0, le=65535, description="the port the peer will listen on (0: any; not checked)")
    announce_maddrs: list[str] = Field(default_factory=list, description="addresses the peer will announce")
    public: bool = Field(False, description="the swarm is on the internet: announced addresses must be public")
    run_id: str = Field("gasloc", description="the run to join: its initial peers answer the reachability "
                        "probe (can they dial this machine back?)")
    checkpoint_dir: Path = Field(Path("runs"), description="where checkpoints will be written")
    min_free_disk_gb: float = Field(2.0, ge=0, description="FAIL below this much free disk (WARN below 4x)")
    timeout_s: float = Field(10.0, gt=0, description="per network step (p2pd start, connect, ping)")
    max_clock_skew_s: float = Field(3.0, gt=0, description="FAIL above this clock difference to a peer (WARN "
                                    "above a third of it); hivemind's own limit is 3 s")
    peer_config: Path | None = Field(None, description="the config file the peer will run with (gasloc peer "
                                     "--config): what it sends on the wire is read from it; unset: the defaults")

    @field_validator("initial_peers")
    @classmethod
    def _peers(cls, v: list[str]) -> list[str]:
        from gasloc.runtime.maddrs import expand_initial_peers

        return expand_initial_peers(v)

    @field_validator("announce_maddrs")
    @classmethod
    def _announce(cls, v: list[str]) -> list[str]:
        for m in v:
            if not m.startswith("/"):
                raise ValueError(f"{m!r} is not a multiaddr (like /ip4/203.0.113.7/tcp/31337)")
        return v


def run_checks(cfg: DoctorConfig) -> list:
    from gasloc.cli.doctor_checks import (
        check_codec,
        check_cuda,
        check_dir_writable,
        check_disk,
        check_memory,
        check_port,
        network_checks,
    )

    checks = [check_port(cfg.port)]
    port = checks[0].status == "OK" and cfg.port or 0   # a port in use would make p2pd fail: probe another
    checks += network_checks(cfg.initial_peers, cfg.announce_maddrs, cfg.public, cfg.timeout_s, cfg.max_clock_skew_s,
                             port=port, run_id=cfg.run_id)
    checks += [check_dir_writable(cfg.checkpoint_dir), check_disk(cfg.checkpoint_dir, cfg.min_free_disk_gb),
               check_cuda(), check_memory(cfg.peer_config), check_codec(cfg.peer_config)]
    return checks


def render(checks: list) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(soft_wrap=False)
    if not console.is_terminal:
        console = Console(width=160)
    style = {"OK": "green", "WARN": "yellow", "FAIL": "bold red", "SKIP": "dim"}
    t = Table(title="gasloc doctor", title_justify="left")
    for col in ("check", "status", "detail", "fix"):
        t.add_column(col, overflow="fold")
    for c in checks:
        t.add_row(c.name, f"[{style[c.status]}]{c.status}[/]", c.detail, c.fix)
    console.print(t)
    fails = [c for c in checks if c.status == "FAIL"]
    warns = [c for c in checks if c.status == "WARN"]
    console.print(f"{len(fails)} failed, {len(warns)} warning(s), "
                  f"{sum(c.status == 'OK' for c in checks)} ok")
    for c in fails:  # one plain line per failure, easy to grep and to paste into an issue
        console.print(f"FAIL {c.name}: {c.detail} -> fix: {c.fix}", markup=False, soft_wrap=True)


@click.command()
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="TOML with DoctorConfig keys")
@click.option("--print-config", is_flag=True, help="print the resolved config as TOML and exit")
@click.option("--initial-peers", multiple=True, metavar="MADDR|FILE", help="peer or bootstrap to try (repeatable)")
@click.option("--port", type=int, help="port the peer will listen on")
@click.option("--announce-maddrs", multiple=True, help="address the peer will announce (repeatable)")
@click.option("--public", is_flag=True, default=None, help="joining an internet swarm: require a public address")
@click.option("--run-id", help="the run to join (its peers answer the reachability probe) [gasloc]")
@click.option("--checkpoint-dir", type=click.Path(), help="where checkpoints will go [runs]")
@click.option("--timeout-s", type=float, help="per network step [10]")
@click.option("--peer-config", type=click.Path(dir_okay=False),
              help="the peer's config file (its wire codec, and whether its round fits in memory)")
def doctor(config_file, print_config, **flags) -> None:
    """Check this machine for a swarm: p2pd, initial peers, addresses, port, clock, GPU, disk; exit 1 on FAIL."""
    from gasloc.runtime.config import resolve_for_cli
    from gasloc.runtime.logs import setup_logging

    cfg = resolve_for_cli(DoctorConfig, config_file, flags, print_config)
    setup_logging("WARNING")
    checks = run_checks(cfg)
    render(checks)
    sys.exit(1 if any(c.status == "FAIL" for c in checks) else 0)
