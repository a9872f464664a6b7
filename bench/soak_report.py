"""The soak benchmark's figures from what it recorded (pure: no processes, unit-tested): exchanges past their
deadline, non-finite values, the swarm's validation-loss trend, per-peer RSS and fd growth, restarts that resumed
vs re-joined. bench/soak.py runs the swarm and calls `analyse`."""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Incarnation:
    """One process of one peer (a restart is a new incarnation of the same peer)."""
    peer: str
    name: str                 # supervisor name, unique per incarnation: p3, p3#2, ...
    started: float            # unix time of its start
    why: str                  # initial | restart-after-kill9 | rejoin-after-sigterm | joiner
    hard_killed: bool = False
    rounds: list[dict] = field(default_factory=list)       # its metrics.jsonl round events
    starts: list[dict] = field(default_factory=list)       # its start events (one)
    mem: list[tuple[float, float, int]] = field(default_factory=list)  # (unix time, RSS bytes, open fds)


def _window_mean(samples: list[tuple[float, float, int]], lo: float, hi: float, idx: int) -> float | None:
    vals = [s[idx] for s in samples if lo <= s[0] < hi]
    return statistics.fmean(vals) if vals else None


def growth(inc: Incarnation, t0: float, ref: tuple[float, float], last: tuple[float, float]) -> dict[str, Any]:
    """RSS growth (relative) and fd growth (absolute, rounded means) of one incarnation between the reference
    window and the last window (seconds since t0); None where the process did not live through both."""
    out: dict[str, Any] = {"rss_growth": None, "fd_growth": None, "rss_mb_ref": None, "rss_mb_last": None}
    r0 = _window_mean(inc.mem, t0 + ref[0], t0 + ref[1], 1)
    r1 = _window_mean(inc.mem, t0 + last[0], t0 + last[1], 1)
    f0 = _window_mean(inc.mem, t0 + ref[0], t0 + ref[1], 2)
    f1 = _window_mean(inc.mem, t0 + last[0], t0 + last[1], 2)
    if r0 and r1:
        out.update(rss_growth=r1 / r0 - 1, rss_mb_ref=r0 / 1e6, rss_mb_last=r1 / 1e6)
    if f0 is not None and f1 is not None:
        out["fd_growth"] = round(f1) - round(f0)
    return out


def swarm_val_loss(incs: list[Incarnation], t0: float, bucket_s: float) -> list[tuple[float, float]]:
    """(minutes since t0, mean validation loss) per time bucket over every peer's evaluations in it."""
    buckets: dict[int, list[float]] = {}
    for inc in incs:
        for r in inc.rounds:
            if r.get("val_loss") is not None and r["time"] >= t0:
                buckets.setdefault(int((r["time"] - t0) // bucket_s), []).append(r["val_loss"])
    return [((k + 0.5) * bucket_s / 60, statistics.fmean(v)) for k, v in sorted(buckets.items())]


def _frozen(inc: Incarnation, r: dict, stops: list[tuple[str, float]], stop_s: float) -> bool:
    """Whether round `r` of `inc` was in flight while its own process tree was SIGSTOPped: then its clock ran on
    while it could not act, and an exchange past its deadline is the fault itself, not the exchange ignoring it."""
    lo = r["time"] - r.get("exchange_s", 0.0) - 1.0  # the exchange ends the round (1 s: the outer step after it)
    return any(peer == inc.peer and at < r["time"] and at + stop_s > lo for peer, at in stops)


def analyse(incs: list[Incarnation], *, t0: float, t1: float, exchange_timeout_s: float, grace_s: float,
            leftovers: dict[str, list[str]], faults: list[dict], stop_s: float = 20.0) -> dict[str, Any]:
    """Every figure of the report. Windows scale with the run: at 30 min, the reference is minutes 5-10 and the
    last window minutes 25-30; the loss trend compares the first 5 minutes' last evaluations with the end's."""
    dur = t1 - t0
    sixth = dur / 6
    ref, last = (sixth, 2 * sixth), (dur - sixth, dur)
    rounds = [r for inc in incs for r in inc.rounds]
    stops = [(f["peer"], f["time"]) for f in faults if f.get("kind") == "sigstop"]
    late = [(inc, r) for inc in incs for r in inc.rounds if r.get("exchange_s", 0) > exchange_timeout_s + grace_s]
    past_deadline = [r for inc, r in late if not _frozen(inc, r, stops, stop_s)]
    past_deadline_frozen = [r for inc, r in late if _frozen(inc, r, stops, stop_s)]
    # metrics.jsonl writes NaN/inf as null: a null training loss is a non-finite value in our own model; a
    # NOT_FINITE rejection is a partner's non-finite tensors, refused before any mixing
    nonfinite_own = [r for r in rounds if r.get("loss") is None]
    nonfinite_refused = [r for r in rounds if r.get("code") == "NOT_FINITE"]
    mixed_nonfinite = [r for r in rounds if r.get("outcome") == "ok" and r.get("consensus") is None
                       and r.get("group_size", 2) == 2]
    curve = swarm_val_loss(incs, t0, bucket_s=max(30.0, dur / 30))
    # "after the first 5 minutes": the last bucket that ends within the first sixth; the end: the last sixth's mean
    early = [v for m, v in curve if m * 60 <= sixth][-1:] or [v for _, v in curve[:1]]
    end = [v for m, v in curve if m * 60 >= dur - sixth] or [v for _, v in curve[-1:]]
    restarts = []
    for inc in incs:
        if inc.why in ("restart-after-kill9", "rejoin-after-sigterm", "joiner"):
            start = inc.starts[0] if inc.starts else {}
            jf = start.get("joined_from")
            restarts.append({"peer": inc.peer, "name": inc.name, "why": inc.why,
                             "became": "resumed" if jf == "checkpoint" else "re-joined" if jf else
                             "fresh" if start else "never started", "round": start.get("round")})
    # only processes that were up before the reference window began: one (re)started inside it is still loading
    unjudged = dict.fromkeys(("rss_growth", "fd_growth", "rss_mb_ref", "rss_mb_last"))
    per_peer = {inc.name: growth(inc, t0, ref, last) if inc.started <= t0 + ref[0] else unjudged for inc in incs}
    judged = {n: g for n, g in per_peer.items() if g["rss_growth"] is not None}
    return {
        "duration_s": dur, "rounds": len(rounds), "faults": faults,
        "exchanges": sum(1 for r in rounds if r.get("attempts")),
        "exchanges_ok": sum(1 for r in rounds if r.get("outcome") == "ok"),
        "past_deadline": len(past_deadline),
        "past_deadline_worst_s": max((r["exchange_s"] for r in past_deadline), default=None),
        "past_deadline_while_stopped": len(past_deadline_frozen),
        "past_deadline_while_stopped_worst_s": max((r["exchange_s"] for r in past_deadline_frozen), default=None),
        "nonfinite_own_loss": len(nonfinite_own), "nonfinite_refused": len(nonfinite_refused),
        "nonfinite_mixed": len(mixed_nonfinite),
        "val_loss_curve": curve, "val_loss_early": statistics.fmean(early) if early else None,
        "val_loss_end": statistics.fmean(end) if end else None,
        "orphan_processes": leftovers.get("processes", []), "leftover_sockets": leftovers.get("sockets", []),
        "leftover_sockets_of_kill9": leftovers.get("sockets_of_kill9", []),
        "leftover_shm": leftovers.get("shm", []),
        "per_process": per_peer,
        "max_rss_growth": max((g["rss_growth"] for g in judged.values()), default=None),
        "max_fd_growth": max((g["fd_growth"] for g in judged.values() if g["fd_growth"] is not None), default=None),
        "restarts": restarts,
        "windows_min": {"ref": [ref[0] / 60, ref[1] / 60], "last": [last[0] / 60, last[1] / 60]},
    }


def format_table(res: dict[str, Any]) -> str:
    def f(v, fmt):
        return "n/a" if v is None else format(v, fmt)

    w = res["windows_min"]
    became = {}
    for r in res["restarts"]:
        became[(r["why"], r["became"])] = became.get((r["why"], r["became"]), 0) + 1
    lines = [
        f"soak: {res['duration_s'] / 60:.1f} min, {len(res['faults'])} faults, {res['rounds']} rounds, "
        f"{res['exchanges_ok']} ok exchanges of {res['exchanges']} rounds with attempts",
        "| figure | value | target |", "|---|---|---|",
        f"| exchanges past their deadline | {res['past_deadline']} (worst {f(res['past_deadline_worst_s'], '.2f')} s; "
        f"not counted: {res.get('past_deadline_while_stopped', 0)} in flight while their own process was "
        f"SIGSTOPped, worst {f(res.get('past_deadline_while_stopped_worst_s'), '.2f')} s) | 0 |",
        f"| non-finite values mixed in | {res['nonfinite_mixed']} (own NaN loss {res['nonfinite_own_loss']}, "
        f"partners' refused {res['nonfinite_refused']}) | 0 |",
        f"| swarm val loss, first window -> end | {f(res['val_loss_early'], '.3f')} -> {f(res['val_loss_end'], '.3f')}"
        " | lower at the end |",
        f"| orphan processes at the end | {len(res['orphan_processes'])} | 0 |",
        f"| leftover sockets (clean exits) | {len(res['leftover_sockets'])} (of kill -9'd or crashed processes: "
        f"{len(res['leftover_sockets_of_kill9'])}, removed) | 0 |",
        f"| leftover /dev/shm/torch_* files | {len(res['leftover_shm'])} | 0 |",
        f"| exit codes at the end, not 0 | {res.get('bad_exits') or 'none'} | none |",
        f"| max RSS growth per process, min {w['last'][0]:.1f}-{w['last'][1]:.1f} vs {w['ref'][0]:.1f}-"
        f"{w['ref'][1]:.1f} | {f(None if res['max_rss_growth'] is None else 100 * res['max_rss_growth'], '+.1f')} %"
        " | < 5 % |",
        f"| max open-fd growth per process | {f(res['max_fd_growth'], '+d')} | 0 |",
        "| restarts | " + (", ".join(f"{why}: {n} {b}" for (why, b), n in sorted(became.items())) or "none")
        + " | resumed (joiners: re-joined) |",
    ]
    lines += ["", "| process | RSS MB ref -> last | RSS growth | fd growth |", "|---|---|---|---|"]
    for name, g in sorted(res["per_process"].items()):
        if g["rss_growth"] is None:
            continue
        lines.append(f"| {name} | {g['rss_mb_ref']:.0f} -> {g['rss_mb_last']:.0f} | {100 * g['rss_growth']:+.1f} % |"
                     f" {f(g['fd_growth'], '+d')} |")
    return "\n".join(lines)
