"""What `gasloc status` shows, without any I/O: the swarm as its DHT records describe it (rows and totals), the
history a live view accumulates (loss over time per peer, who exchanged with whom recently), and the rich table.

Everything in a record beyond its signature is the peer's own claim (its round, loss, throughput, bandwidth,
partners): the view says so ("claimed" in the JSON, a footnote under the table) rather than presenting it as fact.
"""
from __future__ import annotations

import math
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from gasloc.peer.swarm.membership import PeerRecord, status_view


class StatusError(RuntimeError):
    """The DHT could not be reached or did not answer: one line for the user."""


CLAIMED = ("round", "state", "loss", "val_loss", "tokens_per_s", "bandwidth_bps", "round_s", "partners", "version")


def _finite(v: float | None) -> float | None:
    return v if v is not None and math.isfinite(v) else None


def _shown(v: Any) -> Any:
    """An undeclared claim of a view as JSON and the table can show it: numbers, text, booleans as they are (text
    cut, non-finite numbers as None), anything else (msgpack also carries bytes and tuples) as its cut repr."""
    if v is None or isinstance(v, (bool, int)):
        return v
    if isinstance(v, float):
        return _finite(v)
    return (v if isinstance(v, str) else repr(v))[:SHOWN_CHARS]


SHOWN_CHARS = 120


def peer_row(rec: PeerRecord, now: float) -> dict[str, Any]:
    """One peer as the status view shows it (JSON-ready)."""
    view = status_view(rec)
    extra = {k: _shown(v) for k, v in (view.dict() if view else {}).items()
             if k not in ("loss", "val_loss", "round_s", "partners", "version")}
    return {
        "peer_id": rec.peer_id, "state": rec.state, "round": rec.round, "protocol": rec.protocol,
        "fingerprint": rec.fingerprint, "tokens_per_s": _finite(rec.throughput_tps),
        "bandwidth_bps": _finite(rec.bandwidth_bps) or None,  # 0.0 in a record means "not measured yet"
        "loss": _finite(view.loss) if view else None, "val_loss": _finite(view.val_loss) if view else None,
        "round_s": _finite(view.round_s) if view else None, "partners": list(view.partners) if view else [],
        "version": view.version if view else None,
        # reachability and whatever later versions add to the view, shown as they come
        "reachability": extra.pop("reachability", None), "extra": extra,
        "announced_s_ago": _finite(max(0.0, now - rec.time)),   # a claimed time of -inf: None, not Infinity
    }


def totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Peers by state, summed throughput and rounds per minute (from each peer's claimed mean round time)."""
    states = Counter(r["state"] for r in rows)
    fingerprints = Counter(r["fingerprint"] for r in rows)
    return {
        "peers": len(rows), "by_state": dict(states),
        # sums of finite claims can still overflow (two peers claiming 1e308 tok/s): None then, never Infinity,
        # which JSON (and the status page's JSON.parse) does not have
        "tokens_per_s": _finite(sum(r["tokens_per_s"] or 0.0 for r in rows)),
        "rounds_per_min": _finite(sum(60.0 / r["round_s"] for r in rows if r["round_s"] and r["round_s"] > 0)),
        "configs": len(fingerprints),  # more than one: peers that cannot pair with each other share the run id
    }


def snapshot(records: dict[str, PeerRecord], *, run_id: str, now: float, sampling: dict[str, Any] | None = None
             ) -> dict[str, Any]:
    """`sampling`: which of the run's DHT buckets were read ({"buckets_read", "buckets", "estimate"}); a snapshot
    of some of them is `sampled` (its rows are that share of the swarm, its estimate the swarm's size)."""
    rows = sorted((peer_row(r, now) for r in records.values()), key=lambda r: (-r["round"], r["peer_id"]))
    sampled = sampling is not None and sampling["buckets_read"] < sampling["buckets"]
    return {"run_id": run_id, "time": now, "sampled": sampled, "sampling": sampling, "claimed": list(CLAIMED),
            "peers": rows, "totals": totals(rows)}


def sampling_line(snap: dict[str, Any]) -> str:
    """What part of the swarm a snapshot shows: every bucket, or a sample and the size it suggests."""
    s = snap.get("sampling")
    if not s:
        return ""
    if snap["sampled"]:
        return f"sampled {s['buckets_read']} of {s['buckets']} buckets, ~{s['estimate']:.0f} peers estimated"
    return f"read all {s['buckets']} bucket(s) of the swarm"


@dataclass
class History:
    """What a live view remembers between listings: per peer, (time, round, loss, val_loss) at each new round, and
    for each pair of peers the last time one of them listed the other among its recent partners."""
    max_points: int = 500
    edge_window_s: float = 120.0
    curves: dict[str, deque] = field(default_factory=dict)
    edges: dict[tuple[str, str], float] = field(default_factory=dict)
    _last_partner: dict[str, str] = field(default_factory=dict)

    def add(self, snap: dict[str, Any]) -> None:
        now = snap["time"]
        for row in snap["peers"]:
            pid = row["peer_id"]
            curve = self.curves.setdefault(pid, deque(maxlen=self.max_points))
            if row["loss"] is not None and (not curve or curve[-1][1] != row["round"]):
                curve.append((now, row["round"], row["loss"], row["val_loss"]))
            partners = row["partners"]
            # an edge is fresh when its partner list changed since the last listing (a new exchange), or at the first
            # sight of a peer (its newest partner); the rest of the list is older news
            if partners and self._last_partner.get(pid) != partners[-1]:
                self.edges[tuple(sorted((pid, partners[-1])))] = now
                self._last_partner[pid] = partners[-1]
        for pair, t in list(self.edges.items()):
            if now - t > self.edge_window_s:
                del self.edges[pair]

    def to_json(self) -> dict[str, Any]:
        return {
            "curves": {pid: [{"time": t, "round": r, "loss": lo, "val_loss": v} for t, r, lo, v in c]
                       for pid, c in self.curves.items()},
            "edges": [{"a": a, "b": b, "last_seen": t} for (a, b), t in sorted(self.edges.items())],
            "edge_window_s": self.edge_window_s,
        }


def short(peer_id: str) -> str:
    return peer_id if len(peer_id) <= 12 else f"{peer_id[:6]}…{peer_id[-4:]}"


def _num(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def render_table(snap: dict[str, Any], initial_peers: list[str]):
    """The rich table of a snapshot (or the one line that says nobody is there)."""
    from rich.table import Table
    from rich.text import Text

    rows, tot = snap["peers"], snap["totals"]
    if not rows:
        return Text(no_peers_line(snap["run_id"], initial_peers))
    main_fp = Counter(r["fingerprint"] for r in rows).most_common(1)[0][0]
    t = Table(title=f"gasloc status: run {snap['run_id']!r}, {time.strftime('%H:%M:%S', time.localtime(snap['time']))}",
              caption="* the peer's own claim, from its signed DHT record" +
                      (f"; {sampling_line(snap)}" if snap.get("sampling") else ""))
    for col in ("peer", "state*", "round*", "loss*", "val loss*", "tok/s*", "MB/s*", "s/round*", "proto",
                "version*", "reach", "seen s ago"):
        t.add_column(col, justify="left" if col in ("peer", "state*", "reach") else "right")
    for r in rows:
        peer = short(r["peer_id"]) + ("" if r["fingerprint"] == main_fp else " (other config)")
        t.add_row(peer, r["state"], str(r["round"]), _num(r["loss"], ".3f"), _num(r["val_loss"], ".3f"),
                  _num(r["tokens_per_s"], ".0f"),
                  _num(r["bandwidth_bps"] / 1e6 if r["bandwidth_bps"] else None, ".1f"),
                  _num(r["round_s"], ".1f"), str(r["protocol"]), r["version"] or "-", r["reachability"] or "-",
                  _num(r["announced_s_ago"], ".0f"))
    by_state = ", ".join(f"{n} {s}" for s, n in sorted(tot["by_state"].items()))
    t.add_section()
    t.add_row(f"{tot['peers']} peers", by_state, "", "", "", _num(tot["tokens_per_s"], ".0f"), "",
              f"{_num(tot['rounds_per_min'], '.1f')}/min", "", "", "", "")
    return t


def no_peers_line(run_id: str, initial_peers: list[str]) -> str:
    via = initial_peers[0] if len(initial_peers) == 1 else f"{len(initial_peers)} initial peers"
    return f"no peers in sight for run id {run_id!r} (asked the DHT through {via})"
