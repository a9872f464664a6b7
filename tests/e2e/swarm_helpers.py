"""Shared pieces of the live-swarm e2e tests: a fast tiny-model peer config, starting peers, reading their rounds,
and a DHT client in the test process that reads the run's peer listing (what every peer sees)."""
from __future__ import annotations

import contextlib
import time
from collections import Counter
from pathlib import Path

from e2e.harness import LOOPBACK, Harness

RUN_ID = "e2e"

# Short rounds (5 inner steps of a tiny model) so a few minutes on 2 shared cores cover dozens of rounds.
PEER_TOML = """
[model]
preset = "tiny"
seq_len = 64
[data]
batch_size = 4
val_batches = 2
[inner]
inner_steps = 10
warmup_steps = 10
lr = 0.002
[exchange]
exchange_timeout_s = 2.5
accept_timeout_s = 1.0
[swarm]
run_id = "{run_id}"
announce_ttl_s = {ttl_s}
partner_deadline_s = {deadline_s}
min_backoff_s = 1.0
max_backoff_s = 8.0
[diloco]
matchmaking_time_s = 2.0
request_timeout_s = 1.0
averaging_timeout_s = 15.0
next_chunk_timeout_s = 5.0
[run]
eval_every_rounds = 2
"""


def write_config(h: Harness, *, ttl_s: float = 6.0, deadline_s: float = 1.2) -> Path:
    path = h.run_dir / "peer.toml"
    path.write_text(PEER_TOML.format(run_id=RUN_ID, ttl_s=ttl_s, deadline_s=deadline_s))
    return path


def start_peers(h: Harness, names: list[str], boot: list[str], config: Path, *extra: str) -> dict:
    """Spawn all at once (their start-ups overlap), then wait for every READY line; name -> peer id."""
    children = {n: h.spawn(n, "peer", "--config", config, "--initial-peers", boot[0], "--host-maddrs", LOOPBACK,
                           "--run-dir", h.dir(n), *extra) for n in names}
    return {n: h.wait_ready(c, 150)["peer_id"] for n, c in children.items()}


def rounds(h: Harness, name: str) -> list[dict]:
    return [r for r in h.metrics(name) if r.get("event") == "round"]


def start_event(h: Harness, name: str) -> dict:
    return next(r for r in h.metrics(name) if r.get("event") == "start")


def ok_partners(rs: list[dict]) -> Counter:
    return Counter(r["partner"] for r in rs if r["outcome"] == "ok")


def val_losses(rs: list[dict]) -> list[float]:
    return [r["val_loss"] for r in rs if r.get("val_loss") is not None]


def steps_per_s(rs: list[dict], t0: float, t1: float) -> float:
    """Inner steps per wall-clock second of the rounds that ended within [t0, t1]."""
    return sum(r["inner_steps"] for r in rs if t0 <= r["time"] <= t1) / (t1 - t0)


@contextlib.contextmanager
def listing(boot: list[str]):
    """A DHT client in the test process; yields a function returning {peer_id: PeerRecord} of the run's live
    records, read from the network (latest=True) as a peer would."""
    from gasloc.peer.membership import parse_listing, peers_key
    from gasloc.peer.safeproc import SafeDHT

    dht = SafeDHT(initial_peers=boot, start=True, client_mode=True, host_maddrs=[LOOPBACK])
    try:
        yield lambda: parse_listing(dht.get(peers_key(RUN_ID), latest=True), time.time())
    finally:
        dht.shutdown()
