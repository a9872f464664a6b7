"""Shared pieces of the live-swarm e2e tests: a fast tiny-model peer config, starting peers, reading their rounds,
and an observer process that reads the run's peer listing from the DHT (what every peer sees)."""
from __future__ import annotations

import json
import sys
import time
from collections import Counter
from pathlib import Path

from e2e.harness import LOOPBACK, Harness, child_env

RUN_ID = "e2e"

# Short rounds (10 inner steps of a tiny model, ~1 s) so a few minutes on 2 shared cores cover dozens of rounds.
PEER_TOML = """
[model]
preset = "tiny"
seq_len = 64
[data]
batch_size = 4
val_batches = 2
[inner]
inner_steps = {inner_steps}
warmup_steps = 10
lr = 0.002
[exchange]
exchange_timeout_s = 2.5
accept_timeout_s = 1.0
[swarm]
run_id = "{run_id}"
announce_ttl_s = {ttl_s}
partner_deadline_s = {deadline_s}
min_backoff_s = 3.0
max_backoff_s = 8.0
bandwidth_weighting = {bandwidth_weighting}
[diloco]
matchmaking_time_s = 2.0
request_timeout_s = 1.0
averaging_timeout_s = 15.0
next_chunk_timeout_s = 5.0
[run]
eval_every_rounds = 2
[outer]
overlap = {overlap}
[guard]
val_margin = {val_margin}
"""


def write_config(h: Harness, *, ttl_s: float = 6.0, deadline_s: float = 1.2, inner_steps: int = 10,
                 overlap: bool = False, bandwidth_weighting: bool = False, val_margin: float = 0.1) -> Path:
    path = h.run_dir / "peer.toml"
    path.write_text(PEER_TOML.format(run_id=RUN_ID, ttl_s=ttl_s, deadline_s=deadline_s, inner_steps=inner_steps,
                                     overlap=str(overlap).lower(),
                                     bandwidth_weighting=str(bandwidth_weighting).lower(), val_margin=val_margin))
    return path


def start_peers(h: Harness, names: list[str], boot: list[str], config: Path, *extra: str,
                per_peer: dict[str, tuple] | None = None) -> dict:
    """Spawn all at once (their start-ups overlap), then wait for every READY line; name -> peer id. `per_peer`:
    further arguments of some peers."""
    children = {n: h.spawn(n, "peer", "--config", config, "--initial-peers", boot[0], "--host-maddrs", LOOPBACK,
                           "--run-dir", h.dir(n), *extra, *(per_peer or {}).get(n, ())) for n in names}
    return {n: h.wait_ready(c, 150)["peer_id"] for n, c in children.items()}


def rounds(h: Harness, name: str) -> list[dict]:
    return [r for r in h.metrics(name) if r.get("event") == "round"]


def state_round(h: Harness, name: str) -> int:
    """The round of the state the peer last held: its last round's, or a later resync's (a catch-up at the round's
    end takes over the donor's round count; one still downloading when a stop signal comes is given up)."""
    return [r for r in h.metrics(name) if r.get("event") in ("round", "resync")][-1]["round"]


def start_event(h: Harness, name: str) -> dict:
    return next(r for r in h.metrics(name) if r.get("event") == "start")


def ok_partners(rs: list[dict]) -> Counter:
    return Counter(r["partner"] for r in rs if r["outcome"] == "ok")


def all_have(h: Harness, names: list[str], ok_rounds: int, partners: int, since: float = 0.0):
    """A wait_until condition: each of `names` has >= ok_rounds ok exchanges with >= partners distinct partners
    in its rounds since `since`."""
    def check() -> bool:
        for n in names:
            got = ok_partners([r for r in rounds(h, n) if r["time"] >= since])
            if sum(got.values()) < ok_rounds or len(got) < partners:
                return False
        return True
    return check


def val_losses(rs: list[dict]) -> list[float]:
    return [r["val_loss"] for r in rs if r.get("val_loss") is not None]


def overhead_s(rs: list[dict], t0: float, t1: float) -> list[float]:
    """Per-round seconds outside the inner phase (partner search, exchange, outer update, evaluation) of the rounds
    that ended within [t0, t1]. What a frozen or dead peer can cost the others shows here; the seconds of the inner
    steps move with the load on the shared test machine (other jobs, or the frozen peer's CPU coming free) and say
    nothing about the swarm."""
    return [r["round_s"] - r["compute_s"] for r in rs if t0 <= r["time"] <= t1]


class Listing:
    """The run's live peer listing as a separate observer process sees it (tests/e2e/peer_lister.py), started
    under the harness so it is stopped and leak-checked like every other child."""

    def __init__(self, h: Harness, boot: list[str]):
        self.h, self.path = h, h.run_dir / "listing.json"
        argv = [sys.executable, str(Path(__file__).with_name("peer_lister.py")), "--initial-peers", *boot,
                "--run-id", RUN_ID, "--out", str(self.path)]
        self.child = h.sup.start("lister", argv, h.run_dir / "lister.log", env=child_env())
        h.wait_until(self.path.exists, 60, "the listing observer's first listing", alive=("lister",))

    def __call__(self, since: float | None = None) -> dict[str, dict] | None:
        """{peer_id: record} of the latest listing (at most a second old); with `since`, None until a listing
        taken after that time exists."""
        snap = json.loads(self.path.read_text())
        if since is not None and snap["time"] <= since:
            return None
        assert time.time() - snap["time"] < 1.0, f"listing observer stalled: {self.h.log('lister')[-2000:]}"
        return snap["peers"]
