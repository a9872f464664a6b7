"""`gasloc status`: see the whole swarm from anywhere, without a central server. It joins the DHT as a client (it
stores nothing and serves nobody), reads the run's signed peer records, and prints them: once, as JSON, refreshed in
place (--watch), or as a live web page with a JSON endpoint (--serve PORT, gasloc.cli.statusweb).

Exit codes: 0 (also when nobody is there: that is said in one line), 1 the DHT could not be reached, 2 bad options.
"""
from __future__ import annotations

import json
import signal
import sys
import threading

import click
from pydantic import BaseModel, ConfigDict, Field, field_validator

from gasloc.cli.statusview import StatusError
from gasloc.protocol.messages import check_run_id
from gasloc.runtime.maddrs import expand_initial_peers


class StatusConfig(BaseModel):
    """A look at a running swarm through its DHT."""
    model_config = ConfigDict(extra="forbid")

    initial_peers: list[str] = Field(min_length=1, description="multiaddrs of peers or bootstrap nodes of the "
                                     "swarm, or files listing them (one per line)")
    run_id: str = Field("gasloc", description="the training run to look at (its DHT key)")
    timeout_s: float = Field(20.0, gt=0, description="how long joining the DHT and each listing may take")
    interval_s: float = Field(2.0, gt=0, description="--watch and --serve: seconds between listings")
    serve_port: int | None = Field(None, ge=0, le=65535, description="serve the live page and /api/swarm on this "
                                   "port (0: any free port; the address is printed)")
    host: str = Field("127.0.0.1", description="--serve: address to bind (0.0.0.0: every interface)")
    edge_window_s: float = Field(120.0, gt=0, description="--serve: an exchange stays on the page's graph this "
                                 "long after a peer last announced it")

    @field_validator("initial_peers")
    @classmethod
    def _peers(cls, v: list[str]) -> list[str]:
        return expand_initial_peers(v)

    _run_id = field_validator("run_id")(check_run_id)


STATUS_MAX_BUCKETS = 16   # a swarm in at most this many buckets is read whole; a larger one, this many of them


class Observer:
    """A client-mode DHT node that reads the run's records. Create it from the main thread (it forks). A small
    swarm (up to STATUS_MAX_BUCKETS buckets) is read whole, its level and the one below (a writer one level under
    ours has its copies there); a larger one is sampled, and the snapshot says so (`sampling`)."""

    def __init__(self, cfg: StatusConfig):
        from gasloc.peer.swarm.membership import BucketReader, make_validators
        from gasloc.runtime.aio import LoopThread
        from gasloc.runtime.safeproc import SafeDHT

        self.cfg = cfg
        try:
            # the validators also strip the records' signatures: without them hivemind cannot decode a signed value
            self.dht = SafeDHT(initial_peers=cfg.initial_peers, start=True, client_mode=True,
                               host_maddrs=["/ip4/127.0.0.1/tcp/0"], startup_timeout=cfg.timeout_s,
                               record_validators=make_validators(cfg.run_id)[1], await_ready=True)
        except Exception as e:  # noqa: BLE001 - whatever hivemind raised, the user gets one line and exit 1
            first = (str(e).strip().splitlines() or [""])[0]
            raise StatusError(f"could not join the DHT through {', '.join(cfg.initial_peers)} "
                              f"({type(e).__name__}: {first}); are those peers running and reachable?") from None
        self.reader = BucketReader(self.dht, run_id=cfg.run_id, request_timeout_s=cfg.timeout_s)
        self.aio = LoopThread("status")

    async def _read(self) -> tuple[dict | None, dict]:
        r = self.reader
        probed = await r.probe()
        if probed is None:
            return None, {}
        level = r.level
        levels = [lv for lv in (level, level - 1) if lv >= 0]
        if sum(1 << lv for lv in levels) <= STATUS_MAX_BUCKETS + STATUS_MAX_BUCKETS // 2:
            found = await r.read([(lv, b) for lv in levels for b in range(1 << lv)], sample=False)
            read = 1 << level
        else:
            picks = r.rng.sample(range(1 << level), STATUS_MAX_BUCKETS)
            found = await r.read([(level, b) for b in picks])
            read = STATUS_MAX_BUCKETS
        records = {**probed, **(found or {})}
        estimate = r.estimate.value if read < (1 << level) else float(len(records))
        return records, {"buckets_read": read, "buckets": 1 << level, "estimate": estimate}

    def snapshot(self) -> dict:
        from hivemind.utils.timed_storage import get_dht_time

        from gasloc.cli.statusview import snapshot

        try:
            records, sampling = self.aio.run(self._read(), self.cfg.timeout_s * 3)
        except TimeoutError:
            records = None
        if records is None:
            raise StatusError(f"the DHT did not answer within {self.cfg.timeout_s:.0f} s")
        now = get_dht_time()
        return snapshot(records, run_id=self.cfg.run_id, now=now, sampling=sampling)

    def close(self) -> None:
        # No remove_own_shm() here (unlike the peer): the DHT futures' shared-memory tensors are still alive, and
        # torch aborts the process (SIGABRT, exit -6) when their destructor finds the file already unlinked.
        # They are freed, and their files unlinked by torch, as the interpreter exits.
        self.aio.stop()
        self.dht.shutdown()


def run(cfg: StatusConfig, *, as_json: bool, watch: bool) -> int:
    from rich.console import Console

    from gasloc.cli.statusview import no_peers_line, render_table

    console = Console()
    if not console.is_terminal:  # a pipe or a file: wide enough that the table does not wrap
        console = Console(width=160)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    obs = Observer(cfg)
    try:
        if cfg.serve_port is not None:
            from gasloc.cli.statusweb import serve
            return serve(cfg, obs, stop)
        if not watch:
            snap = obs.snapshot()
            if as_json:
                click.echo(json.dumps(snap, indent=1))
            elif not snap["peers"]:
                click.echo(no_peers_line(cfg.run_id, cfg.initial_peers))
            else:
                console.print(render_table(snap, cfg.initial_peers))
            return 0
        from rich.live import Live
        with Live(console=console, refresh_per_second=4, screen=False) as live:
            while not stop.is_set():
                snap = obs.snapshot()
                if as_json:
                    click.echo(json.dumps(snap))
                else:
                    live.update(render_table(snap, cfg.initial_peers))
                stop.wait(cfg.interval_s)
        return 0
    finally:
        obs.close()


@click.command()
@click.option("--initial-peers", multiple=True, metavar="MADDR|FILE", help="a peer or bootstrap node of the "
              "swarm (full multiaddr), or a file of them (repeatable)")
@click.option("--run-id", help="training run to look at [gasloc]")
@click.option("--json", "as_json", is_flag=True, help="print the snapshot as JSON (with --watch: one line per "
              "listing)")
@click.option("--watch", is_flag=True, help="refresh in place every --interval seconds until Ctrl+C")
@click.option("--interval", "interval_s", type=float, help="seconds between listings [2]")
@click.option("--serve", "serve_port", type=int, metavar="PORT", help="serve a live page and /api/swarm on PORT "
              "(0: any free port)")
@click.option("--host", help="--serve: address to bind [127.0.0.1]")
@click.option("--timeout", "timeout_s", type=float, help="seconds for joining the DHT and each listing [20]")
def status(as_json, watch, **flags) -> None:
    """Show every peer of a run in sight: state, round, loss, throughput, bandwidth (each the peer's own claim)."""
    from gasloc.runtime.config import ConfigError, resolve
    from gasloc.runtime.logs import setup_logging

    if not flags["initial_peers"]:
        click.echo("Error: --initial-peers is required: a multiaddr (or a file of them) of a peer or bootstrap node "
                   "of the swarm", err=True)
        sys.exit(2)
    try:
        # GASLOC_* variables configure peers; status reads none of them (environ={})
        cfg = resolve(StatusConfig, None, flags, environ={})
    except ConfigError as e:
        click.echo(f"Error: {e}", err=True)
        sys.exit(2)
    setup_logging("ERROR")  # hivemind's chatter would tear the table
    try:
        sys.exit(run(cfg, as_json=as_json, watch=watch))
    except StatusError as e:
        click.echo(f"Error: {e}", err=True)
        sys.exit(1)
