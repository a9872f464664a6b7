"""The simulator's clock numbers, measured from bench/hetero.py's own runs (its --out-dir): what `gasloc sim compare
--suite hetero` must assume to model that bench (issue 15 item 2).

    python bench/hetero_calibrate.py runs/hetero-A runs/hetero-B ...   # one or more out dirs of bench/hetero.py

From every peer's metrics.jsonl (peers p0, p2, ... on --fast-mbit links, p1, p3, ... on --slow-mbit):
- seconds per inner step: the rounds' compute_s over their inner steps;
- link efficiency: the nominal time of a transfer (its bytes over the slower tbf rate; a ring all-reduce's
  2 (n-1)/n of them for DiLoCo) over its measured transfer_s, for GASLoC's pair exchanges and DiLoCo's all-reduces,
  and over every transfer that crossed a slow link (slow_link_efficiency: the simulator's clock.link_efficiency);
- the spread of the largest groups' all-reduce times (allreduce_cv, from the interquartile range:
  search.allreduce_jitter);
- the listing at the start (DiLoCo runs: each round records its target group, 1 + the peers it listed): how many of
  the others a peer listed at its first round (first_round_listed_share: search.discovery_share), and the median
  over such peers of the last time one still listed fewer than all (partial_listing_until_s: search.discovery_s).
Medians over everything given. Only reads files.
"""
from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

import click

TARGET = re.compile(r"target_group_size=(\d+)")


def _peers(run_dir: Path) -> dict[str, list[dict]]:
    out = {}
    for m in sorted(run_dir.glob("p*/metrics.jsonl")):
        events = []
        for line in m.read_text().splitlines():
            try:
                events.append(json.loads(line))
            except ValueError:
                continue  # a line cut by the stop: not a measurement
        out[m.parent.name] = events
    return out


def _fast(name: str) -> bool:
    return int(name[1:]) % 2 == 0


def measure(out_dirs: list[Path], fast_mbit: float, slow_mbit: float) -> dict:
    steps, compute = 0, 0.0
    pair_eff: dict[str, list[float]] = {"fast-fast": [], "fast-slow": [], "slow-slow": []}
    pair_s: dict[str, list[float]] = {k: [] for k in pair_eff}
    ar_eff: list[float] = []
    slow_eff: list[float] = []  # every transfer that crossed a slow link, pair or all-reduce
    ar_s: dict[int, list[float]] = {}
    first_listed: list[int] = []
    partial_until: list[float] = []
    runs = 0
    for out in out_dirs:
        for run_dir in sorted(p for p in out.iterdir() if p.is_dir()):
            peers = _peers(run_dir)
            if not peers:
                continue
            runs += 1
            ids = {e["peer_id"]: n for n, evs in peers.items() for e in evs if e.get("event") == "start"}
            t0 = min((e["time"] for evs in peers.values() for e in evs if e.get("event") == "start"), default=0.0)
            n_peers = len(peers)
            for name, evs in peers.items():
                rounds = [e for e in evs if e.get("event") == "round"]
                diloco = any(e.get("algorithm") == "diloco" for e in evs if e.get("event") == "start")
                for e in rounds:
                    if e.get("inner_steps"):
                        steps += e["inner_steps"]
                        compute += e.get("compute_s") or 0.0
                    ok = e.get("outcome") == "ok" and (e.get("transfer_s") or 0) > 0 and e.get("bytes_received")
                    if ok and not diloco and e.get("partner") in ids:
                        kind = "-".join(sorted(("fast" if _fast(n) else "slow") for n in (name, ids[e["partner"]])))
                        bw = (fast_mbit if kind == "fast-fast" else slow_mbit) * 1e6
                        pair_eff[kind].append(e["bytes_received"] * 8 / bw / e["transfer_s"])
                        pair_s[kind].append(e["transfer_s"])
                        if kind != "fast-fast":
                            slow_eff.append(pair_eff[kind][-1])
                    if ok and diloco and (e.get("group_size") or 0) >= 2:
                        n = e["group_size"]
                        members = [name] + [ids.get(p, "p1") for p in (e.get("partner") or "").split(",") if p]
                        bw = (fast_mbit if all(_fast(m) for m in members) else slow_mbit) * 1e6
                        # bytes_received is derived as 2 (n-1)/n of the vector (peer/swarm/diloco.py)
                        ar_eff.append(e["bytes_received"] * 8 / bw / e["transfer_s"])
                        ar_s.setdefault(n, []).append(e["transfer_s"])
                        if bw < fast_mbit * 1e6:
                            slow_eff.append(ar_eff[-1])
                if diloco:
                    listed = []
                    for e in rounds:
                        m = TARGET.search(e.get("detail") or "")
                        # the listing is read when the inner steps are done
                        listed.append((e["time"] - (e.get("round_s") or 0.0) + (e.get("compute_s") or 0.0) - t0,
                                       int(m.group(1)) - 1 if m else (0 if "no other live" in (e.get("detail") or "")
                                                                      else None)))
                    listed = [x for x in listed if x[1] is not None]
                    if listed:
                        first_listed.append(listed[0][1])
                        partial = [t for t, c in listed if c < n_peers - 1]
                        if partial:
                            partial_until.append(max(partial))

    def med(xs):
        return round(statistics.median(xs), 4) if xs else None

    def spread(xs):  # a coefficient of variation that a few stalled all-reduces (60 s chunk retries) do not swamp
        if len(xs) < 4:
            return None
        q = statistics.quantiles(xs, n=4)
        return round((q[2] - q[0]) / 1.349 / statistics.median(xs), 3)

    full = ar_s.get(max(ar_s), []) if ar_s else []

    return {"runs": runs, "seconds_per_step": round(compute / steps, 4) if steps else None,
            "pair_efficiency": {k: med(v) for k, v in pair_eff.items()},
            "pair_exchange_s": {k: med(v) for k, v in pair_s.items()},
            "pair_count": {k: len(v) for k, v in pair_eff.items()},
            "slow_link_efficiency": med(slow_eff), "allreduce_efficiency": med(ar_eff), "allreduce_count": len(ar_eff),
            "allreduce_s_by_group": {str(n): med(v) for n, v in sorted(ar_s.items())},
            "allreduce_cv": spread(full),
            "first_round_listed_share": (round(sum(first_listed) / (len(first_listed) * (n_peers - 1)), 3)
                                         if first_listed else None),
            "first_round_listed": first_listed,
            "partial_listing_until_s": med(partial_until), "partial_listing_peers": len(partial_until)}


@click.command()
@click.argument("out_dirs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False))
@click.option("--fast-mbit", type=click.FloatRange(0.1), default=30.0, show_default=True)
@click.option("--slow-mbit", type=click.FloatRange(0.1), default=3.0, show_default=True)
def main(out_dirs, fast_mbit, slow_mbit) -> None:
    """Measure the simulator's clock numbers from bench/hetero.py out dirs."""
    res = measure([Path(d) for d in out_dirs], fast_mbit, slow_mbit)
    if not res["runs"]:
        raise click.ClickException(f"no run with peers' metrics.jsonl under {', '.join(out_dirs)} (give "
                                   "bench/hetero.py --out-dir folders)")
    click.echo(json.dumps(res, indent=2))


if __name__ == "__main__":
    sys.exit(main())
