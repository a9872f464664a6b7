"""Analysis for bench/hetero.py, pure (files in, numbers and text out): the swarm's mean validation loss over time,
time to a target, and where each peer's round time went.

The swarm's mean validation loss at time t = mean over peers of each peer's latest val_loss at or before t; a
peer's start event (initial_loss) is its first value.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

PARTS = ("compute_s", "wait_s", "transfer_s", "outer_s")
DROP_FRACTIONS = (0.5, 0.75, 0.9, 1.0)  # milestones: this fraction of the way from the initial loss to the target
GOAL_RATIO = 0.5  # issue 30 (against a one-model DiLoCo): GASLoC's time to target <= 0.5x DiLoCo's; issue #5 asked 0.6x
JUMP_NATS = 0.2                         # a "jump": a round after which a peer's validation loss rose this much


@dataclass
class RunResult:
    name: str
    algorithm: str
    bandwidth_aware: bool | None
    duration_s: float
    curve: list[tuple[float, float]]          # (seconds since t0, swarm mean val loss), at each change
    breakdown: dict[str, dict[str, float]] = field(default_factory=dict)  # "fast" / "slow" -> per-peer means
    pairs: dict[str, float] = field(default_factory=dict)  # ok pairwise exchanges by the partners' link classes
    jumps: dict[str, dict] = field(default_factory=dict)  # fast peers' rounds by partner: see mix_jumps
    t0: float = 0.0                           # Unix time the run's clock started (every peer READY)
    repeat: int = 0                           # which repetition of its run (1, 2, ...; 0: the run was made once)
    base: str = ""                            # the run's name without its repetition's suffix ("" : name)

    @property
    def run(self) -> str:
        return self.base or self.name

    @property
    def initial_loss(self) -> float:
        return self.curve[0][1]

    @property
    def final_loss(self) -> float:
        return self.curve[-1][1]

    def time_to(self, level: float) -> float | None:
        return next((t for t, loss in self.curve if loss <= level), None)


def read_events(path: Path) -> list[dict]:
    out = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return out
    for line in lines:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line torn by a kill
    return out


def loss_points(events: list[dict]) -> list[tuple[float, float]]:
    pts = []
    for e in events:
        if e.get("event") == "start" and e.get("initial_loss") is not None:
            pts.append((float(e["time"]), float(e["initial_loss"])))
        elif e.get("event") == "round" and e.get("val_loss") is not None:
            pts.append((float(e["time"]), float(e["val_loss"])))
    return sorted(pts)


def mean_loss_curve(points_by_peer: dict[str, list[tuple[float, float]]], t0: float, t_end: float
                    ) -> list[tuple[float, float]]:
    """(t - t0, mean over peers of their latest loss at or before t) at t0 and at every change in (t0, t_end];
    empty until every peer has a value."""
    merged = sorted((t, peer, loss) for peer, pts in points_by_peer.items() for t, loss in pts if t <= t_end)
    latest: dict[str, float] = {}
    curve: list[tuple[float, float]] = []
    n = len(points_by_peer)
    i = 0
    while i < len(merged) and merged[i][0] <= t0:
        latest[merged[i][1]] = merged[i][2]
        i += 1
    if len(latest) == n:
        curve.append((0.0, sum(latest.values()) / n))
    for t, peer, loss in merged[i:]:
        latest[peer] = loss
        if len(latest) == n:
            curve.append((t - t0, sum(latest.values()) / n))
    return curve


def breakdown(events_by_peer: dict[str, list[dict]], groups: dict[str, set[str]], t0: float, t_end: float
              ) -> dict[str, dict[str, float]]:
    """Per group of peers, the per-peer means of: rounds, inner steps, ok exchanges, slower peers passed over
    (summed over rounds), and seconds spent computing, waiting for a partner/group, transferring, in the outer step,
    and the rest of the round (evaluation, ...)."""
    out = {}
    for group, members in groups.items():
        tot = {"rounds": 0.0, "inner_steps": 0.0, "ok": 0.0, "passed_over": 0.0, "round_s": 0.0,
               **{p: 0.0 for p in PARTS}}
        for peer in members:
            for e in events_by_peer.get(peer, []):
                if e.get("event") != "round" or not t0 <= float(e["time"]) <= t_end:
                    continue
                tot["rounds"] += 1
                tot["inner_steps"] += e.get("inner_steps") or 0
                tot["ok"] += e.get("outcome") == "ok"
                tot["passed_over"] += e.get("passed_over") or 0
                tot["round_s"] += e.get("round_s") or 0.0
                for p in PARTS:
                    tot[p] += e.get(p) or 0.0
        k = max(len(members), 1)
        row = {key: v / k for key, v in tot.items()}
        row["other_s"] = max(0.0, row["round_s"] - sum(row[p] for p in PARTS))
        out[group] = row
    return out


def pair_counts(events_by_peer: dict[str, list[dict]], fast: set[str], t0: float, t_end: float) -> dict[str, float]:
    """Successful pairwise exchanges in [t0, t_end] by link class of the two partners: fast-fast, fast-slow,
    slow-slow. Each exchange is logged by both partners, so every side counts one half."""
    ids = {e["peer_id"]: peer for peer, evs in events_by_peer.items() for e in evs
           if e.get("event") == "start" and e.get("peer_id")}
    out = {"fast-fast": 0.0, "fast-slow": 0.0, "slow-slow": 0.0}
    for peer, evs in events_by_peer.items():
        for e in evs:
            if (e.get("event") != "round" or e.get("outcome") != "ok" or e.get("group_size") != 2
                    or e.get("partner") not in ids or not t0 <= float(e["time"]) <= t_end):
                continue
            kinds = sorted("fast" if p in fast else "slow" for p in (peer, ids[e["partner"]]))
            out["-".join(kinds)] += 0.5
    return out


def mix_jumps(events_by_peer: dict[str, list[dict]], fast: set[str], t0: float, t_end: float
              ) -> dict[str, dict]:
    """Fast peers' rounds in [t0, t_end] that mixed with a partner, split by whether it was the partner of the
    peer's previous exchange ("same") or another one ("new"): how many, how many of them raised the peer's
    validation loss by JUMP_NATS or more over the round, and the largest rise (None without such rounds; negative
    when every one of them lowered the loss).

    Why: fast peers that pair mostly with each other drift away from the rest of the swarm, and averaging two
    models that drifted apart can cost loss (docs/hetero-results.md); the swarm mean alone hides it."""
    out: dict[str, dict] = {kind: {"rounds": 0, "jumps": 0, "max_rise": None} for kind in ("same", "new")}
    for peer in fast:
        prev_loss, prev_partner = None, None
        for e in events_by_peer.get(peer, []):
            if e.get("event") == "start":
                prev_loss = e.get("initial_loss")
                continue
            if e.get("event") != "round":
                continue
            loss, mixed = e.get("val_loss"), e.get("outcome") == "ok" and e.get("group_size") == 2
            if mixed and loss is not None and prev_loss is not None and t0 <= float(e["time"]) <= t_end:
                row = out["same" if e.get("partner") == prev_partner else "new"]
                rise = loss - prev_loss
                row["rounds"] += 1
                row["jumps"] += rise >= JUMP_NATS
                row["max_rise"] = rise if row["max_rise"] is None else max(row["max_rise"], rise)
            if mixed:
                prev_partner = e.get("partner")
            if loss is not None:
                prev_loss = loss
    return out


def analyse_run(name: str, algorithm: str, bandwidth_aware: bool | None, metrics: dict[str, Path],
                fast: set[str], t0: float, t_end: float) -> RunResult:
    events = {peer: read_events(path) for peer, path in metrics.items()}
    points = {p: loss_points(ev) for p, ev in events.items()}
    curve = mean_loss_curve(points, t0, t_end)
    if not curve:
        missing = [p for p, pts in points.items() if not pts]
        raise ValueError(f"run {name}: no loss recorded by {missing} (see their logs next to metrics.jsonl)")
    groups = {"fast": set(fast) & set(events), "slow": set(events) - set(fast)}
    split = breakdown(events, groups, t0, t_end)
    for group, members in groups.items():   # the swarm mean hides how far each link class got
        part = mean_loss_curve({p: points[p] for p in members}, t0, t_end)
        split[group]["final_loss"] = part[-1][1] if part else None
    pairwise = algorithm != "diloco"
    return RunResult(name, algorithm, bandwidth_aware, t_end - t0, curve, split,
                     pair_counts(events, set(fast), t0, t_end) if pairwise else {},
                     mix_jumps(events, set(fast), t0, t_end) if pairwise else {}, t0)


def pick_target(results: list[RunResult], margin: float) -> float:
    """A loss every run reaches: the highest final mean loss plus `margin`."""
    return max(r.final_loss for r in results) + margin


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def repeat_summary(results: list[RunResult], target: float) -> dict[str, dict]:
    """Per run over its repetitions: the median (and range) of the time to target and of the final loss, and the
    median time against DiLoCo's median time: what the bench's verdict rests on when runs were repeated (two runs
    of one swarm one after another differed by up to 3 % in loss, either way: docs/codecs.md, L4-L8)."""
    by_run: dict[str, list[RunResult]] = {}
    for r in results:
        by_run.setdefault(r.run, []).append(r)
    times = {n: [t for r in rs if (t := r.time_to(target)) is not None] for n, rs in by_run.items()}
    ref = next((n for n, rs in by_run.items() if rs[0].algorithm == "diloco"), None)
    # a run some repetition of which never reached the target has no median time (never the case with
    # pick_target's target, which every run reaches)
    whole = {n: len(times[n]) == len(rs) for n, rs in by_run.items()}
    ref_t = statistics.median(times[ref]) if ref and whole[ref] else None
    out = {}
    for n, rs in by_run.items():
        t, finals = statistics.median(times[n]) if whole[n] else None, [r.final_loss for r in rs]
        out[n] = {"algorithm": rs[0].algorithm, "repetitions": len(rs),
                  "time_to_target_median_s": None if t is None else round(t, 2),
                  "time_to_target_range_s": [round(min(times[n]), 2), round(max(times[n]), 2)] if whole[n] else None,
                  "final_loss_median": round(statistics.median(finals), 5),
                  "final_loss_range": [round(min(finals), 5), round(max(finals), 5)],
                  "ratio_to_diloco": None if t is None or not ref_t else round(t / ref_t, 3)}
    return out


def format_report(results: list[RunResult], target: float, settings: dict) -> tuple[str, dict]:
    # each run against DiLoCo's run of the same repetition (the same stretch of the machine's time)
    refs = {}
    for r in results:
        if r.algorithm == "diloco":
            refs.setdefault(r.repeat, r)
    repeated = any(r.repeat for r in results)
    rows, lines = [], []
    lines.append(f"target loss {target:.4f} (highest final mean loss + {settings.get('target_margin', 0):g})")
    lines.append("| run | algorithm | bandwidth-aware | time to target s | x DiLoCo | initial loss | final loss | "
                 "duration s |")
    lines.append("|---|---|---|---|---|---|---|---|")
    ratios = {}
    for r in results:
        t = r.time_to(target)
        ref_t = refs[r.repeat].time_to(target) if r.repeat in refs else None
        ratio = t / ref_t if (t is not None and ref_t) else None
        ratios[r.name] = ratio
        bw = "n/a" if r.bandwidth_aware is None else ("on" if r.bandwidth_aware else "off")
        lines.append(f"| {r.name} | {r.algorithm} | {bw} | {_fmt(t)} | {_fmt(ratio, '.2f')} | "
                     f"{r.initial_loss:.4f} | {r.final_loss:.4f} | {r.duration_s:.0f} |")
        rows.append({"run": r.name, "algorithm": r.algorithm, "bandwidth_aware": r.bandwidth_aware,
                     "target_loss": round(target, 5), "time_to_target_s": None if t is None else round(t, 2),
                     "final_loss": round(r.final_loss, 5), "duration_s": round(r.duration_s, 2), "t0_unix": r.t0,
                     "ratio_to_diloco": None if ratio is None else round(ratio, 3), "repeat": r.repeat})

    # milestones: a common scale from the mean initial loss down to the target
    start = sum(r.initial_loss for r in results) / len(results)
    levels = [start - f * (start - target) for f in DROP_FRACTIONS]
    lines.append("")
    lines.append("time (s) to reach a fraction of the drop from the initial loss (%.3f) to the target:" % start)
    lines.append("| run | " + " | ".join(f"{int(f * 100)}% ({lv:.3f})" for f, lv in zip(DROP_FRACTIONS, levels))
                 + " |")
    lines.append("|---|" + "---|" * len(levels))
    milestones = {}
    for r in results:
        ts = [r.time_to(lv) for lv in levels]
        milestones[r.name] = [None if t is None else round(t, 2) for t in ts]
        lines.append(f"| {r.name} | " + " | ".join(_fmt(t) for t in ts) + " |")

    lines.append("")
    lines.append("where a peer's round time went (per-peer means over the run; % of the run's round time):")
    lines.append("| run | links | final loss | rounds | inner steps | ok exchanges | s/round | compute | wait | "
                 "transfer | outer | eval+other |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        for group, b in r.breakdown.items():
            rs = b["round_s"] or 1.0
            lines.append(f"| {r.name} | {group} | {_fmt(b.get('final_loss'), '.4f')} | {b['rounds']:.1f} | "
                         f"{b['inner_steps']:.0f} | {b['ok']:.1f} | {b['round_s'] / max(b['rounds'], 1):.2f} | "
                         + " | ".join(f"{100 * b[p] / rs:.0f}%" for p in (*PARTS, "other_s")) + " |")

    if any(r.pairs for r in results):  # DiLoCo has none: its groups of two (while peers join) are no pairing
        lines.append("")
        lines.append("successful pairwise exchanges by the partners' links; slower peers a fast peer passed over "
                     "(per fast peer, summed over its rounds):")
        lines.append("| run | fast-fast | fast-slow | slow-slow | passed over |")
        lines.append("|---|---|---|---|---|")
        for r in results:
            if r.pairs:
                lines.append(f"| {r.name} | {r.pairs['fast-fast']:.0f} | {r.pairs['fast-slow']:.0f} | "
                             f"{r.pairs['slow-slow']:.0f} | {r.breakdown.get('fast', {}).get('passed_over', 0):.1f} |")

    if any(r.jumps for r in results):
        lines.append("")
        lines.append(f"fast peers' rounds that mixed with the partner of their previous exchange (same) or another "
                     f"(new): how many, how many raised the peer's validation loss by {JUMP_NATS} or more, the "
                     f"largest rise:")
        lines.append("| run | same: rounds | jumps | largest rise | new: rounds | jumps | largest rise |")
        lines.append("|---|---|---|---|---|---|---|")
        for r in results:
            if r.jumps:
                lines.append(f"| {r.name} | " + " | ".join(
                    f"{r.jumps[k]['rounds']} | {r.jumps[k]['jumps']} | {_fmt(r.jumps[k]['max_rise'], '+.2f')}"
                    for k in ("same", "new")) + " |")

    summary = repeat_summary(results, target) if repeated else {}
    if repeated:
        lines.append("")
        lines.append("over the repetitions (each run's median and range; the order of the runs alternated): the "
                     "verdict below reads these")
        lines.append("| run | repetitions | time to target s, median | range | x DiLoCo's median | final loss, median "
                     "| range |")
        lines.append("|---|---|---|---|---|---|---|")
        for n, m in summary.items():
            tr, fr = m["time_to_target_range_s"], m["final_loss_range"]
            lines.append(f"| {n} | {m['repetitions']} | {_fmt(m['time_to_target_median_s'])} | "
                         f"{'-' if tr is None else f'{tr[0]:.1f}-{tr[1]:.1f}'} | {_fmt(m['ratio_to_diloco'], '.2f')} | "
                         f"{m['final_loss_median']:.4f} | {fr[0]:.4f}-{fr[1]:.4f} |")
    verdict = []
    judged = ({n: m["ratio_to_diloco"] for n, m in summary.items() if m["algorithm"] == "gasloc"} if repeated else
              {r.name: ratios.get(r.name) for r in results if r.algorithm == "gasloc"})
    for n, ratio in judged.items():
        if ratio is not None:
            verdict.append(f"{n}: {ratio:.2f}x DiLoCo's time{' (medians)' if repeated else ''} -> "
                           f"{'met' if ratio <= GOAL_RATIO else 'NOT met'}")
    lines.append("")
    lines.append(f"goal GASLoC <= {GOAL_RATIO}x DiLoCo's time to target: " + ("; ".join(verdict) or
                                                                              "no GASLoC and DiLoCo pair to compare"))
    doc = {"rows": rows, "target_loss": round(target, 5), "milestone_fractions": list(DROP_FRACTIONS),
           "milestone_levels": [round(lv, 5) for lv in levels], "milestones_s": milestones,
           "breakdown": {r.name: r.breakdown for r in results}, "pairs": {r.name: r.pairs for r in results},
           "jumps": {r.name: r.jumps for r in results}, "settings": settings, "repeats": summary,
           "curves": {r.name: [[round(t, 2), round(v, 5)] for t, v in r.curve] for r in results}}
    return "\n".join(lines), doc
