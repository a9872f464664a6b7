"""`gasloc sim compare`: suites of simulated runs that test the paper's claims, and their markdown report.

A suite is a base config plus named runs (overrides of the base); a run may take its stopping rule from another
run's result (claim c: run GASLoC until it reaches DiLoCo's final loss or DiLoCo's wall-clock). Each claim reads
the results and says PASS or FAIL with the numbers it compared. Runs are independent processes when jobs > 1.
"""
from __future__ import annotations

import concurrent.futures as cf
import fnmatch
import multiprocessing
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gasloc.runtime.config import flags_tree

Result = dict
Results = dict[str, Result]
SuiteProgress = Callable[[int, int, float, float | None], None]


@dataclass(frozen=True)
class RunSpec:
    name: str
    overrides: dict                     # dotted keys over the suite's base, e.g. {"outer.algorithm": "diloco"}
    after: str | None = None            # a run whose result `derive` reads
    derive: Callable[[Result], dict] | None = None  # -> more dotted overrides, from `after`'s result


@dataclass(frozen=True)
class Claim:
    name: str
    text: str
    check: Callable[[Results], tuple[bool, str]]  # -> (passed, the numbers in words)


@dataclass(frozen=True)
class Suite:
    name: str
    base: dict
    runs: list[RunSpec]
    claims: list[Claim]
    notes: list[str] = field(default_factory=list)


def _final(r: Result) -> float:
    return r["final_val_loss"]


def _same_tokens(*runs: Result) -> bool:
    """Equal tokens up to the last round's overshoot: an asynchronous swarm ends mid-round for some workers."""
    toks = [r["tokens"] for r in runs]
    return max(toks) <= 1.01 * min(toks)


def _tokens(*runs: Result) -> str:
    """The runs' token counts for a claim's numbers, with a warning where they are not equal (_same_tokens)."""
    toks = sorted({r["tokens"] for r in runs})
    text = f"{toks[0]:,} tokens" if len(toks) == 1 else f"{' / '.join(f'{t:,}' for t in toks)} tokens"
    return text + ("" if _same_tokens(*runs) else " (token counts differ by more than 1%!)")


def claim_below(topology: str) -> Callable[[Results], tuple[bool, str]]:
    def check(res: Results) -> tuple[bool, str]:
        g, gos, nol = (res[f"a-{topology}-{a}"] for a in ("gasloc", "gossip", "noloco"))
        ok = _same_tokens(g, gos, nol) and _final(g) < _final(gos) and _final(g) < _final(nol)
        return ok, (f"GASLoC {_final(g):.4f} vs gossip-AdamW {_final(gos):.4f} ({_final(g) - _final(gos):+.4f}) and "
                    f"NoLoCo {_final(nol):.4f} ({_final(g) - _final(nol):+.4f}) at {_tokens(g, gos, nol)}")
    return check


def claim_within(tol: float, gasloc: str = "b-gasloc", diloco: str = "b-diloco") -> Callable[[Results], tuple[bool, str]]:
    def check(res: Results) -> tuple[bool, str]:
        g, d = res[gasloc], res[diloco]
        rel = _final(g) / _final(d) - 1
        return _same_tokens(g, d) and rel <= tol, (f"GASLoC {_final(g):.4f} vs DiLoCo {_final(d):.4f}: "
                                                   f"{100 * rel:+.2f}% (limit +{100 * tol:.0f}%) at {_tokens(g, d)}")
    return check


def time_to_reach(r: Result, loss: float, interpolate: bool = False) -> float | None:
    """Virtual time of the first evaluation at or below `loss` (None: never); with `interpolate`, linearly between
    that evaluation and the one before it."""
    prev = None
    for e in r["evals"]:
        if e["val_loss_mean"] <= loss:
            if not interpolate or prev is None:
                return e["sim_time_s"]
            frac = (prev["val_loss_mean"] - loss) / (prev["val_loss_mean"] - e["val_loss_mean"])
            return prev["sim_time_s"] + frac * (e["sim_time_s"] - prev["sim_time_s"])
        prev = e
    return None


def claim_speedup(limit: float, gasloc: str = "c-gasloc", diloco: str = "c-diloco"
                  ) -> Callable[[Results], tuple[bool, str]]:
    def check(res: Results) -> tuple[bool, str]:
        g, d = res[gasloc], res[diloco]
        target, t_d = _final(d), d["final_sim_time_s"]
        t_g = time_to_reach(g, target)
        if t_g is None:
            best = min(e["val_loss_mean"] for e in g["evals"])
            return False, (f"DiLoCo ends at {target:.4f} after {t_d:,.0f} s; GASLoC never reached it (best "
                           f"{best:.4f} by {g['final_sim_time_s']:,.0f} s)")
        ratio = t_g / t_d
        return ratio <= limit, (f"DiLoCo ends at {target:.4f} after {t_d:,.0f} s; GASLoC reaches it at {t_g:,.0f} s "
                                f"= {ratio:.2f}x (limit {limit}x), having used {g['tokens']:,} tokens vs "
                                f"{d['tokens']:,}")
    return check


def _until_diloco(cap_factor: float) -> Callable[[Result], dict]:
    """Claim c's GASLoC run stops at DiLoCo's final loss, or at DiLoCo's wall-clock, whichever comes first."""
    def derive(d: Result) -> dict:
        return {"target_val_loss": d["final_val_loss"], "max_sim_time_s": d["final_sim_time_s"],
                "rounds": int(d["config"]["rounds"] * cap_factor)}
    return derive


def paper_like(name: str, *, workers: int, base: dict, a: dict, a_gasloc: dict, b: dict, b_gasloc: dict,
               c: dict, c_gasloc: dict, notes: list[str], c_matchmaking_s: float | None = None) -> Suite:
    """The issue's three claims. `a`, `b`, `c`: overrides shared by a claim's runs (H, rounds, lr, ...);
    `*_gasloc`: GASLoC's own settings in that claim (the baselines keep their published defaults).
    `c_matchmaking_s`: claim (c) once more against DiLoCo as the live peer runs it (sim/groups.py: hivemind's
    matchmaking keyed by epoch, a start barrier of every worker, no solo step), beside the lock-step reference."""
    runs: list[RunSpec] = []
    a = {"workers": workers, "inner.inner_steps": 1, **a}
    for topo in ("ring", "random"):
        runs += [RunSpec(f"a-{topo}-gasloc", {**a, "topology": topo, "outer.algorithm": "gasloc", **a_gasloc}),
                 RunSpec(f"a-{topo}-gossip", {**a, "topology": topo, "outer.algorithm": "gossip"}),
                 RunSpec(f"a-{topo}-noloco", {**a, "topology": topo, "outer.algorithm": "noloco"})]
    b = {"workers": workers, **b}
    runs += [RunSpec("b-gasloc", {**b, "topology": "random", "outer.algorithm": "gasloc", **b_gasloc}),
             RunSpec("b-diloco", {**b, "outer.algorithm": "diloco"})]
    c = {"workers": workers, "clock.profile": "half-slow-10x", **c}
    runs += [RunSpec("c-diloco", {**c, "outer.algorithm": "diloco"}),
             RunSpec("c-gasloc", {**c, "topology": "random", "outer.algorithm": "gasloc", **c_gasloc},
                     after="c-diloco", derive=_until_diloco(3.0))]
    if c_matchmaking_s is not None:
        runs += [RunSpec("c-diloco-mm", {**c, "outer.algorithm": "diloco", "search.matchmaking_time_s": c_matchmaking_s}),
                 RunSpec("c-gasloc-mm", {**c, "topology": "random", "outer.algorithm": "gasloc", **c_gasloc},
                         after="c-diloco-mm", derive=_until_diloco(3.0))]
    h = b.get("inner.inner_steps", 20)
    claims = [
        Claim("a-ring", "H=1, ring: GASLoC's final val loss below gossip-AdamW's and NoLoCo's at equal tokens",
              claim_below("ring")),
        Claim("a-random", "H=1, random: GASLoC's final val loss below gossip-AdamW's and NoLoCo's at equal tokens",
              claim_below("random")),
        Claim("b", f"H={h}, random: GASLoC within 2% of DiLoCo's final val loss at equal tokens", claim_within(0.02)),
        Claim("c", "half-slow-10x: GASLoC reaches DiLoCo's final val loss in <= 0.6x DiLoCo's simulated "
              "wall-clock", claim_speedup(0.6)),
    ]
    if c_matchmaking_s is not None:
        claims.append(Claim("c-mm", f"half-slow-10x, DiLoCo with hivemind's matchmaking ({c_matchmaking_s:g} s, keyed "
                            "by epoch) as the live peer runs it: GASLoC reaches its final val loss in <= 0.6x its "
                            "simulated wall-clock", claim_speedup(0.6, "c-gasloc-mm", "c-diloco-mm")))
    return Suite(name, base, runs, claims, notes)


def claim_overlap_loss(profile: str, tol: float) -> Callable[[Results], tuple[bool, str]]:
    def check(res: Results) -> tuple[bool, str]:
        p, o = res[f"{profile}-plain"], res[f"{profile}-overlap"]
        rel = _final(o) / _final(p) - 1
        return _same_tokens(p, o) and rel <= tol, (f"overlap {_final(o):.4f} vs plain {_final(p):.4f}: "
                                                   f"{100 * rel:+.2f}% (limit +{100 * tol:.0f}%) at {_tokens(p, o)}")
    return check


def claim_overlap_speed(profile: str) -> Callable[[Results], tuple[bool, str]]:
    def check(res: Results) -> tuple[bool, str]:
        p, o = res[f"{profile}-plain"], res[f"{profile}-overlap"]
        tps = [r["tokens"] / r["final_sim_time_s"] for r in (p, o)]
        busy = [_busy_share(r) for r in (p, o)]
        target, t_o = _final(o), o["final_sim_time_s"]
        t_p = time_to_reach(p, target, interpolate=True)
        speed = (f"{tps[1] / tps[0]:.2f}x the tokens per simulated second ({tps[1]:,.0f} vs {tps[0]:,.0f}; workers "
                 f"computing {100 * busy[1]:.0f}% of the time vs {100 * busy[0]:.0f}%)")
        if t_p is None:
            return True, f"overlap ends at {target:.4f} after {t_o:,.0f} s, a loss plain mixing never reached; {speed}"
        return t_o < t_p, (f"overlap ends at {target:.4f} after {t_o:,.0f} s; plain mixing reaches it at "
                           f"{t_p:,.0f} s: {t_o / t_p:.2f}x the time; {speed}")
    return check


def _busy_share(r: Result) -> float:
    """Mean share of the run's simulated time that a worker spent on inner steps (the rest: waiting, exchanging)."""
    t = r["final_sim_time_s"]
    shares = [n * link["seconds_per_step"] / t for n, link in zip(r["inner_steps_per_worker"], r["links"])]
    return sum(shares) / len(shares)


def overlap_suite(name: str, *, workers: int, base: dict, run: dict, notes: list[str]) -> Suite:
    """Issue 5's overlap question: does one-round-delayed mixing cost loss, and what does it buy in throughput?
    Same GASLoC settings with and without outer.overlap, on uniform links and on half-slow-10x."""
    runs = [RunSpec(f"{prof}-{mode}", {"workers": workers, "clock.profile": prof, "topology": "random",
                                       "outer.algorithm": "gasloc", **run, "outer.overlap": mode == "overlap"})
            for prof in ("uniform", "half-slow-10x") for mode in ("plain", "overlap")]
    claims = []
    for prof in ("uniform", "half-slow-10x"):
        claims += [Claim(f"loss-{prof}", f"{prof}: overlap's final val loss within 1% of plain mixing's at equal "
                         "tokens", claim_overlap_loss(prof, 0.01)),
                   Claim(f"speed-{prof}", f"{prof}: overlap reaches its final val loss in less simulated time "
                         "than plain mixing needs for the same loss", claim_overlap_speed(prof))]
    return Suite(name, base, runs, claims, notes)


# bench/hetero.py's measured GASLoC/DiLoCo time-to-target ratios against the one-model DiLoCo (docs/hetero-results.md,
# invocations K1-K3 of 2026-12-05 06:51-07:21 UTC, commit 0b42be8, each method's default codec and the lr decayed
# over its rounds): bandwidth-aware 0.33, 0.39, 0.35; uniform 0.33, 0.35, 0.39. Before them (Z1-Z3, 2026-12-02,
# against the live DiLoCo that forked into lineages): bandwidth-aware 0.28, 0.27, 0.32; uniform 0.25, 0.26, 0.30
BENCH_RATIOS = {"gasloc-bw": [0.33, 0.39, 0.35], "gasloc": [0.33, 0.35, 0.39]}
BENCH_TARGET_MARGIN = 0.02  # bench/hetero.py --target-margin's default


def hetero_ratios(res: Results, run: str, seeds: list[int]) -> list[float | None]:
    """Per seed, as bench/hetero.py measures it: target = the highest final mean loss of that seed's runs + the
    margin; ratio = GASLoC's time to it / DiLoCo's (interpolated between evaluations; None: never reached)."""
    out: list[float | None] = []
    for s in seeds:
        runs = [res[f"{n}-s{s}"] for n in ("gasloc-bw", "gasloc", "diloco")]
        target = max(_final(r) for r in runs) + BENCH_TARGET_MARGIN
        t_g, t_d = (time_to_reach(res[f"{n}-s{s}"], target, interpolate=True) for n in (run, "diloco"))
        out.append(None if t_g is None or t_d is None else t_g / t_d)
    return out


def claim_bench_ratio(run: str, seeds: list[int], tol: float) -> Callable[[Results], tuple[bool, str]]:
    def check(res: Results) -> tuple[bool, str]:
        import statistics
        sim = hetero_ratios(res, run, seeds)
        bench = statistics.median(BENCH_RATIOS[run])
        got = [r for r in sim if r is not None]
        if len(got) < len(sim):
            return False, f"per seed {sim}: a run never reached its target"
        med = statistics.median(got)
        pairs = res[f"{run}-s{seeds[0]}"].get("pairs_by_links", {})
        return abs(med - bench) <= tol, (f"simulator {med:.2f}x DiLoCo (median of seeds {', '.join(map(str, seeds))}: "
                                         f"{', '.join(f'{r:.2f}' for r in got)}) vs bench {bench:.2f}x (median of "
                                         f"{len(BENCH_RATIOS[run])}: {', '.join(map(str, BENCH_RATIOS[run]))}); "
                                         f"limit +-{tol}; pairs seed {seeds[0]}: {pairs}")
    return check


def claim_codec(codec: str, seeds: list[int], tol: float) -> Callable[[Results], tuple[bool, str]]:
    """Paired by seed (same init, data and matchings): the codec's final val loss against the fp32 wire's."""
    def check(res: Results) -> tuple[bool, str]:
        rel = [_final(res[f"{codec}-s{s}"]) / _final(res[f"float32-s{s}"]) - 1 for s in seeds]
        mean = sum(rel) / len(rel)
        runs = [res[f"{c}-s{s}"] for s in seeds for c in (codec, "float32")]
        return _same_tokens(*runs) and mean <= tol, (
            f"{codec} {100 * mean:+.2f}% against float32 (mean of seeds {', '.join(map(str, seeds))}: "
            f"{', '.join(f'{100 * r:+.2f}%' for r in rel)}; limit +{100 * tol:g}%) at {_tokens(*runs)}")
    return check


def codec_suite(name: str, *, workers: int, base: dict, b: dict, seeds: list[int], codecs: dict[str, float],
                notes: list[str], c: dict | None = None, c_gasloc: dict | None = None) -> Suite:
    """Issue 32's check of the wire codecs: claim (b)'s GASLoC run once per codec and seed, beside the fp32 wire
    (`codecs`: name -> the loss bound its claim checks, as a fraction over fp32; paired by seed). With `c`: claim
    (c)'s runs too, GASLoC once per codec against one DiLoCo (seed 0), each with claim (c)'s check."""
    b = {"workers": workers, "topology": "random", "outer.algorithm": "gasloc", **b}
    runs = [RunSpec(f"{x}-s{s}", {**b, "seed": s, "codec": x}) for s in seeds for x in ("float32", *codecs)]
    claims = [Claim(x, f"codec {x}: final val loss within {100 * tol:g}% of the fp32 wire's at equal tokens "
                    "(paired seeds)", claim_codec(x, seeds, tol)) for x, tol in codecs.items() if seeds]
    if c is not None:
        c = {"workers": workers, "clock.profile": "half-slow-10x", **c}
        runs.append(RunSpec("c-diloco", {**c, "outer.algorithm": "diloco"}))
        for x in ("float32", *codecs):
            runs.append(RunSpec(f"c-gasloc-{x}", {**c, "topology": "random", "outer.algorithm": "gasloc",
                                                   **(c_gasloc or {}), "codec": x},
                                after="c-diloco", derive=_until_diloco(3.0)))
            claims.append(Claim(f"c-{x}", f"half-slow-10x, codec {x}: GASLoC reaches DiLoCo's final val loss in "
                                "<= 0.6x DiLoCo's simulated wall-clock", claim_speedup(0.6, f"c-gasloc-{x}")))
    return Suite(name, base, runs, claims, notes)


def hetero_suite(name: str, *, base: dict, seeds: list[int], notes: list[str], gasloc: dict | None = None,
                 diloco: dict | None = None) -> Suite:
    """Issue 15's check that the simulator predicts bench/hetero.py: the bench's three runs, per seed (`gasloc`,
    `diloco`: each method's own settings, as the bench gives each its codec and lr decay)."""
    runs = []
    g, d = gasloc or {}, diloco or {}
    for s in seeds:
        runs += [RunSpec(f"gasloc-bw-s{s}", {"seed": s, "outer.algorithm": "gasloc", "bandwidth_weighted": True,
                                             "search.slower_link_ratio": 3.0, **g}),
                 RunSpec(f"gasloc-s{s}", {"seed": s, "outer.algorithm": "gasloc", **g}),
                 RunSpec(f"diloco-s{s}", {"seed": s, "outer.algorithm": "diloco", **d})]
    claims = [Claim("bench-bw", "bandwidth-aware GASLoC's time to target / DiLoCo's within +-0.15 of the bench's",
                    claim_bench_ratio("gasloc-bw", seeds, 0.15)),
              Claim("bench-uniform", "uniform GASLoC's time to target / DiLoCo's within +-0.15 of the bench's",
                    claim_bench_ratio("gasloc", seeds, 0.15))]
    return Suite(name, base, runs, claims, notes)


def h1_tuning_suite(name: str, *, workers: int, base: dict, a: dict, settings: list[tuple[float, float]],
                    notes: list[str]) -> Suite:
    """The source of outer.H_DEFAULTS' H <= 4 row: GASLoC's (gamma, eta) at H = 1 against gossip-AdamW, on ring
    and on random, each run as the paper suite's claim (a) runs it. No claims: the table is the result."""
    runs = []
    a = {"workers": workers, "inner.inner_steps": 1, **a}
    for topo in ("ring", "random"):
        runs.append(RunSpec(f"{topo}-gossip", {**a, "topology": topo, "outer.algorithm": "gossip"}))
        runs += [RunSpec(f"{topo}-g{g:g}-e{e:g}", {**a, "topology": topo, "outer.algorithm": "gasloc",
                                                   "outer.momentum": g, "outer.outer_lr": e})
                 for g, e in settings]
    return Suite(name, base, runs, [], notes)


def h20_tuning_suite(name: str, *, workers: int, base: dict, b: dict, settings: list[tuple[float, float]],
                     notes: list[str]) -> Suite:
    """The check of outer.H_DEFAULTS' H >= 5 row on the live schedule: GASLoC's (gamma, eta) at H = 20 against
    DiLoCo, each run as the paper suite's claim (b) runs it, plus the default row without the guard (how much of
    the gap is the guard's clipping of honest partners). No claims: the table is the result."""
    b = {"workers": workers, **b}
    runs = [RunSpec("diloco", {**b, "outer.algorithm": "diloco"})]
    runs += [RunSpec(f"g{g:g}-e{e:g}", {**b, "topology": "random", "outer.algorithm": "gasloc",
                                        "outer.momentum": g, "outer.outer_lr": e}) for g, e in settings]
    runs.append(RunSpec("default-noguard", {**b, "topology": "random", "outer.algorithm": "gasloc",
                                            "guard.enabled": False}))
    return Suite(name, base, runs, [], notes)


def h20_variants_suite(name: str, *, workers: int, base: dict, b: dict, variants: dict[str, dict],
                       notes: list[str]) -> Suite:
    """Claim (b)'s GASLoC run with one change each (`variants`: name -> dotted overrides), beside DiLoCo: what
    else might close the gap at H = 20 (form, mix momentum with gamma and eta, GASLoC's own inner lr). No claims."""
    b = {"workers": workers, **b}
    runs = [RunSpec("diloco", {**b, "outer.algorithm": "diloco"})]
    runs += [RunSpec(v, {**b, "topology": "random", "outer.algorithm": "gasloc", **over})
             for v, over in variants.items()]
    return Suite(name, base, runs, [], notes)


def decay_suite(name: str, *, workers: int, base: dict, b: dict, schedules: dict[str, dict],
                diloco_lrs: list[float], notes: list[str]) -> Suite:
    """Claim (b) under inner-lr schedules (`schedules`: name -> dotted overrides of inner.total_steps, decay_ratio,
    ...), each applied to both methods alike, with claim (b)'s check at each; `diloco_lrs`: DiLoCo's inner lr again
    under each decaying schedule, whether the shared lr is still its best there."""
    b = {"workers": workers, **b}
    runs, claims = [], []
    for sched, over in schedules.items():
        runs += [RunSpec(f"{sched}-diloco", {**b, "outer.algorithm": "diloco", **over}),
                 RunSpec(f"{sched}-gasloc", {**b, "topology": "random", "outer.algorithm": "gasloc", **over})]
        runs += [RunSpec(f"{sched}-diloco-lr{lr:g}", {**b, "outer.algorithm": "diloco", **over, "inner.lr": lr})
                 for lr in diloco_lrs if over]
        claims.append(Claim(f"b-{sched}", f"H={b.get('inner.inner_steps', 20)}, random, lr schedule {sched}: GASLoC "
                            "within 2% of DiLoCo's final val loss at equal tokens",
                            claim_within(0.02, f"{sched}-gasloc", f"{sched}-diloco")))
    return Suite(name, base, runs, claims, notes)


# ---- running --------------------------------------------------------------------------------------------------

def _config(suite: Suite, spec: RunSpec, extra: dict | None = None):
    from gasloc.sim.config import SimConfig
    return SimConfig.model_validate(flags_tree({**suite.base, **spec.overrides, **(extra or {})}))


def _timed_run(cfg) -> tuple[Result, dict]:
    """A run and what it cost on this machine (kept apart from the result, which must be deterministic).
    peak_rss_mb is the process's peak so far: a run's own where it is the largest the process has run yet."""
    import resource

    from gasloc.sim.runner import run
    wall, cpu = time.perf_counter(), time.process_time()
    result = run(cfg)
    return result, {"wall_s": round(time.perf_counter() - wall, 1), "cpu_s": round(time.process_time() - cpu, 1),
                    "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}


def _run_child(cfg_json: dict) -> tuple[Result, dict]:
    from gasloc.sim.config import SimConfig
    return _timed_run(SimConfig.model_validate(cfg_json))


def run_suite(suite: Suite, jobs: int = 1, progress: SuiteProgress | None = None,
              only: list[str] | None = None) -> dict:
    """Run every run of `suite` (dependents after their source) and check its claims. `only`: the runs whose names
    match one of these shell patterns, and the runs they derive from; a claim that reads a run left out is skipped."""
    started = time.perf_counter()
    results: Results = {}
    timing: dict[str, dict] = {}
    pending = list(suite.runs)
    if only is not None:
        keep = {r.name for r in suite.runs if any(fnmatch.fnmatchcase(r.name, p) for p in only)}
        keep |= {r.after for r in suite.runs if r.name in keep and r.after}
        pending = [r for r in pending if r.name in keep]
        if not pending:
            raise ValueError(f"--only {','.join(only)} matches no run of suite {suite.name}: "
                             f"{', '.join(r.name for r in suite.runs)}")
    total = len(pending)

    sources = {s.after for s in suite.runs if s.after}

    def ready() -> list[RunSpec]:
        # runs that others wait for go first, so a dependent chain overlaps with the independent runs
        out = sorted((s for s in pending if s.after is None or s.after in results),
                     key=lambda s: s.name not in sources)
        for s in out:
            pending.remove(s)
        return out

    def cfg_of(s: RunSpec):
        return _config(suite, s, s.derive(results[s.after]) if s.derive else None)

    def report_progress(last: Result | None) -> None:
        if progress is not None:
            progress(len(results), total, last["final_sim_time_s"] if last else 0.0,
                     last["final_val_loss"] if last else None)

    report_progress(None)
    if jobs == 1:
        while pending:
            for s in ready():
                results[s.name], timing[s.name] = _timed_run(cfg_of(s))
                report_progress(results[s.name])
    else:
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter per worker: no forked torch state
        with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
            running: dict[cf.Future, str] = {}
            while pending or running:
                for s in ready():
                    running[pool.submit(_run_child, cfg_of(s).model_dump(mode="json"))] = s.name
                done, _ = cf.wait(running, return_when=cf.FIRST_COMPLETED)
                for f in done:
                    name = running.pop(f)
                    results[name], timing[name] = f.result()
                    report_progress(results[name])
    claims = []
    for c in suite.claims:
        try:
            ok, numbers = c.check(results)
        except KeyError as e:   # --only left out a run this claim reads
            if only is None:
                raise
            ok, numbers = None, f"not checked: run {e} was not part of this invocation"
        claims.append({"claim": c.name, "text": c.text, "passed": ok, "numbers": numbers})
    order = [s.name for s in suite.runs if s.name in results]
    return {"suite": suite.name, "base": suite.base, "notes": suite.notes,
            "runs": {n: results[n] for n in order}, "claims": claims,
            "timing": {"jobs": jobs, "wall_s": round(time.perf_counter() - started, 1),
                       "cpu_s": round(sum(t["cpu_s"] for t in timing.values()), 1),
                       "runs": {n: timing[n] for n in order}}}


# ---- report ---------------------------------------------------------------------------------------------------

def markdown(report: dict) -> str:
    notes = [f"*{n}.*" for n in report.get("notes", [])]
    lines = [f"### Suite `{report['suite']}`", "", *notes, *([""] if notes else []),
             "| run | algorithm | topology | profile | H | rounds/worker | tokens | sim time (s) | val loss, mean "
             "over workers | val loss, averaged model | consensus | GB sent/worker (nominal) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in report["runs"].items():
        c = r["config"]
        algo = c["outer"]["algorithm"] + (f" ({c['outer']['form']})" if c["outer"]["algorithm"] == "gasloc" else "")
        algo += ", overlap" if c["outer"].get("overlap") else ""
        topo = "all-reduce" if c["outer"]["algorithm"] == "diloco" else c["topology"]
        rounds = r["rounds_per_worker"]
        rw = f"{min(rounds)}" if min(rounds) == max(rounds) else f"{min(rounds)}-{max(rounds)}"
        e = r["evals"][-1]
        gb = sum(r["bytes_sent_per_worker"]) / len(r["bytes_sent_per_worker"]) / 1e9
        lines.append(f"| {name} | {algo} | {topo} | {c['clock']['profile']} | {c['inner']['inner_steps']} | {rw} | "
                     f"{r['tokens']:,} | {e['sim_time_s']:,.0f} | {e['val_loss_mean']:.4f} | "
                     f"{e['val_loss_avg_model']:.4f} | {e['consensus']:.3g} | {gb:,.1f} |")
    lines += ["", "| claim | result | numbers |", "|---|---|---|"]
    for c in report["claims"]:
        verdict = "not run" if c["passed"] is None else f"**{'PASS' if c['passed'] else 'FAIL'}**"
        lines.append(f"| ({c['claim']}) {c['text']} | {verdict} | {c['numbers']} |")
    t = report.get("timing")
    if t:
        lines += ["", f"Ran in {t['wall_s']:,.0f} s wall-clock with {t['jobs']} job(s), {t['cpu_s']:,.0f} CPU-seconds "
                      "in all."]
    return "\n".join(lines) + "\n"


# ---- the suites -----------------------------------------------------------------------------------------------

# Shared by every run of a suite. The numbers come from the tuning recorded in docs/sim-results.md.
PAPER_BASE = {"model.preset": "tiny", "model.seq_len": 64, "data.batch_size": 4, "data.val_batches": 8,
              "inner.warmup_steps": 50, "schedule": "live"}
# the overlap suites: delayed mixing is simulated on the lockstep schedule only
OVERLAP_BASE = {**PAPER_BASE, "schedule": "lockstep"}

# bench/hetero.py's setup (its PEER_TOML and netlab links): 6 peers, even ones on 30 Mbit and odd ones on 3 Mbit, tiny
# preset (885,888 numbers), H = 20, partner deadline 10 s, exchange timeout 60 s, 180 s per run, DiLoCo's matchmaking
# 5 s and its start barrier of all six; every peer evaluates after every round. Each method with its defaults, as the
# bench ran them for K1-K3 (HETERO_GASLOC / HETERO_DILOCO): GASLoC's int8 pairs (its default then; mod4-sd since
# docs/codecs.md G, not yet run on this setup), DiLoCo's float16 all-reduce, and the inner lr decayed by a cosine to
# 0.1 over each method's rounds in 180 s (bench/hetero.py --decay-rounds: 45 and 12). The clock's numbers are the
# bench's own, measured by `bench/hetero_calibrate.py` over the invocations the claims compare with (K1-K3,
# 2026-12-05, 9 runs, commit 0b42be8; docs/sim-results.md): 0.041 s per inner step; transfers over a slow link at 0.86
# of the tbf rate (pair exchanges; 0.67 for hivemind's all-reduce); all-reduce durations with a coefficient of
# variation of 0.145; every peer listed all others from its first round (the barrier waits for them). Over Z1-Z3
# (2026-12-02, fp32 wires, the DiLoCo that forked) they were 0.053 s, 0.73, 0.68, 0.12, and listings that held 0.32 of
# the others for the first 2.9 s
HETERO_BASE = {"workers": 6, "model.preset": "tiny", "model.seq_len": 64, "data.batch_size": 4,
               "data.val_batches": 4, "inner.inner_steps": 20, "inner.warmup_steps": 20, "inner.lr": 2e-3,
               "clock.profile": "hetero-bench", "clock.seconds_per_step": 0.041, "clock.latency_ms": 0.5,
               "clock.bytes_per_param": 4.0, "clock.nominal_params": 885_888, "clock.link_efficiency": 0.86,
               "clock.allreduce_efficiency": 0.67, "search.matchmaking_time_s": 5.0, "search.allreduce_jitter": 0.145,
               "search.discovery_s": 0.0, "search.discovery_share": 1.0,
               "search.partner_deadline_s": 10.0, "search.exchange_timeout_s": 60.0, "rounds": 200,
               "eval_every": 1, "max_sim_time_s": 180.0}
HETERO_GASLOC = {"codec": "int8", "inner.total_steps": 45 * 20}
HETERO_DILOCO = {"clock.bytes_per_param": 2.0, "inner.total_steps": 12 * 20}

SUITES: dict[str, Suite] = {
    "paper": paper_like(
        "paper", workers=8, base=PAPER_BASE,
        # every method with its defaults (GASLoC's outer settings picked from H, outer.H_DEFAULTS) on the live
        # schedule; H=1: inner lr 4e-3 is gossip-AdamW's best of {1, 2, 4, 6}e-3
        a={"rounds": 150, "eval_every": 25, "inner.lr": 4e-3}, a_gasloc={},
        # H=20: inner lr 2e-3 is DiLoCo's best of {1, 2, 4}e-3
        b={"inner.inner_steps": 20, "rounds": 30, "eval_every": 3, "inner.lr": 2e-3}, b_gasloc={},
        # slow links: the live peer's bandwidth-aware choice (bench/hetero.py's gasloc-bw)
        c={"inner.inner_steps": 20, "rounds": 30, "eval_every": 1, "inner.lr": 2e-3},
        c_gasloc={"bandwidth_weighted": True, "search.slower_link_ratio": 3.0},
        notes=["8 workers of the tiny preset (0.9M parameters, byte vocabulary), batch 4 x 64 tokens, one torch "
               "thread per run, validation on 8 x 4 x 64 held-out tokens; the clock charges messages as a "
               "100M-parameter model in fp16 (200 MB); schedule live, every method with its defaults"]),
    # the same claims under the papers' own inner schedule: the lr decays (cosine, to 0.1 of its peak) over each
    # claim's length, for every method alike (DiLoCo's paper trains so); docs/sim-results.md "Claim (b) and the
    # inner lr's decay"
    "paper-cosine": paper_like(
        "paper-cosine", workers=8, base=PAPER_BASE,
        a={"rounds": 150, "eval_every": 25, "inner.lr": 4e-3, "inner.total_steps": 150}, a_gasloc={},
        b={"inner.inner_steps": 20, "rounds": 30, "eval_every": 3, "inner.lr": 2e-3, "inner.total_steps": 600},
        b_gasloc={},
        c={"inner.inner_steps": 20, "rounds": 30, "eval_every": 1, "inner.lr": 2e-3, "inner.total_steps": 600},
        c_gasloc={"bandwidth_weighted": True, "search.slower_link_ratio": 3.0}, c_matchmaking_s=5.0,
        notes=["the paper suite's runs with the inner lr decayed over each claim's length (cosine from the end of "
               "the warm-up to 0.1 of the peak at 150 steps in (a) and 600 in (b) and (c); claim (c)'s GASLoC "
               "stays at the floor past 600)", "claim (c-mm): claim (c) against DiLoCo as the live peer runs it "
               "since 2026-12-05 (hivemind's matchmaking of 5 s keyed by epoch, the start barrier of all 8, no "
               "solo step; sim/groups.py); the lock-step c-diloco stays the reference of claim (c)"]),
    # seconds-long: the same runs and claims at toy size (its verdicts say nothing about the claims)
    "smoke": paper_like(
        "smoke", workers=4,
        base={**PAPER_BASE, "model.seq_len": 32, "data.batch_size": 2, "data.val_batches": 1,
              "inner.warmup_steps": 2},
        a={"rounds": 4, "eval_every": 2}, a_gasloc={},
        b={"inner.inner_steps": 3, "rounds": 2, "eval_every": 1}, b_gasloc={},
        c={"inner.inner_steps": 3, "rounds": 2, "eval_every": 1},
        c_gasloc={"bandwidth_weighted": True, "search.slower_link_ratio": 3.0}, c_matchmaking_s=1.0,
        notes=["a plumbing check at toy size; its verdicts say nothing about the claims"]),
    # the H = 1 sweep behind outer.H_DEFAULTS (docs/sim-results.md): claim (a)'s runs at half its rounds
    "tune-h1": h1_tuning_suite(
        "tune-h1", workers=8, base=PAPER_BASE, a={"rounds": 75, "eval_every": 25, "inner.lr": 4e-3},
        settings=[(0.1, 0.9), (0.1, 1.0), (0.05, 0.95), (0.2, 0.8), (0.2, 0.9)],
        notes=["claim (a)'s setup (8 workers, tiny preset, H = 1, inner lr 4e-3, schedule live) at 75 rounds: "
               "GASLoC's (gamma, eta) against gossip-AdamW on ring and random"]),
    "tune-h1-smoke": h1_tuning_suite(
        "tune-h1-smoke", workers=4, base={**PAPER_BASE, "model.seq_len": 32, "data.batch_size": 2,
                                          "data.val_batches": 1, "inner.warmup_steps": 2},
        a={"rounds": 3, "eval_every": 1}, settings=[(0.1, 0.9)],
        notes=["a plumbing check at toy size; its numbers say nothing"]),
    # the H = 20 sweep on the live schedule (docs/sim-results.md "H = 20 on the live schedule"): claim (b)'s runs
    "tune-h20": h20_tuning_suite(
        "tune-h20", workers=8, base=PAPER_BASE, b={"inner.inner_steps": 20, "rounds": 30, "eval_every": 3,
                                                   "inner.lr": 2e-3},
        settings=[(0.7, 0.7), (0.7, 0.5), (0.5, 0.5)],
        notes=["claim (b)'s setup (8 workers, tiny preset, H = 20, inner lr 2e-3, 30 rounds, random, uniform links, "
               "schedule live): GASLoC's (gamma, eta) against DiLoCo; default-noguard: the default row, guard off"]),
    # claim (b)'s GASLoC with one change each (docs/sim-results.md "H = 20: form B, mix momentum, inner lr")
    "tune-h20-mix": h20_variants_suite(
        "tune-h20-mix", workers=8, base=PAPER_BASE, b={"inner.inner_steps": 20, "rounds": 30, "eval_every": 3,
                                                       "inner.lr": 2e-3},
        variants={"default": {}, "form-B": {"outer.form": "B"},
                  "g0.7-e0.7-k0.5": {"outer.momentum": 0.7, "outer.outer_lr": 0.7, "outer.mix_momentum": 0.5},
                  "g0.9-e0.7-k0.5": {"outer.momentum": 0.9, "outer.outer_lr": 0.7, "outer.mix_momentum": 0.5},
                  "g0.9-e0.5-k0.5": {"outer.momentum": 0.9, "outer.outer_lr": 0.5, "outer.mix_momentum": 0.5},
                  "lr1e-3": {"inner.lr": 1e-3}},
        notes=["claim (b)'s setup (8 workers, tiny preset, H = 20, inner lr 2e-3, 30 rounds, random, uniform links, "
               "schedule live); each GASLoC run changes one thing against the defaults"]),
    # claim (b) under a decaying inner lr (docs/sim-results.md "Claim (b) and the inner lr's decay"): 600 inner steps
    # a worker; warm-up, stable, then linear decay over the last 20%; cosine from the end of the warm-up on
    "decay-h20": decay_suite(
        "decay-h20", workers=8, base=PAPER_BASE, b={"inner.inner_steps": 20, "rounds": 30, "eval_every": 3,
                                                    "inner.lr": 2e-3},
        schedules={"constant": {},
                   "wsd": {"inner.total_steps": 600, "inner.decay_ratio": 0.2, "inner.decay_type": "linear"},
                   "cosine": {"inner.total_steps": 600, "inner.decay_ratio": 1.0, "inner.decay_type": "cosine"}},
        diloco_lrs=[1e-3],
        notes=["claim (b)'s setup (8 workers, tiny preset, H = 20, inner lr 2e-3, 30 rounds, random, uniform links, "
               "schedule live), each method with its defaults, under three inner-lr schedules (min_lr_factor 0.1); "
               "DiLoCo also at inner lr 1e-3 under each decay"]),
    "decay-h20-smoke": decay_suite(
        "decay-h20-smoke", workers=4, base={**PAPER_BASE, "model.seq_len": 32, "data.batch_size": 2,
                                            "data.val_batches": 1, "inner.warmup_steps": 2},
        b={"inner.inner_steps": 3, "rounds": 2, "eval_every": 1},
        schedules={"constant": {}, "cosine": {"inner.total_steps": 6}}, diloco_lrs=[],
        notes=["a plumbing check at toy size; its verdicts say nothing about the claims"]),
    "tune-h20-smoke": h20_tuning_suite(
        "tune-h20-smoke", workers=4, base={**PAPER_BASE, "model.seq_len": 32, "data.batch_size": 2,
                                           "data.val_batches": 1, "inner.warmup_steps": 2},
        b={"inner.inner_steps": 3, "rounds": 2, "eval_every": 1}, settings=[(0.7, 0.5)],
        notes=["a plumbing check at toy size; its numbers say nothing"]),
    # issue 32: the wire codecs on claim (b)'s cosine setup, three seeds (docs/codecs.md)
    "codecs": codec_suite(
        "codecs", workers=8, base=PAPER_BASE,
        b={"inner.inner_steps": 20, "rounds": 30, "eval_every": 3, "inner.lr": 2e-3, "inner.total_steps": 600},
        seeds=[0, 1, 2], codecs={"int8": 0.005, "int4": 0.005, "int4-rn": 0.005, "int4-sd": 0.005, "int3": 0.005,
                                   "int8-p10": 0.02, "int4-p20": 0.02, "mod4": 0.005, "mod4-sd": 0.005,
                                   "mod3-sd": 0.005, "mod4-p25": 0.02, "mod2-p50-sd": 0.02,
                                   "mod8-p50-sd": 0.005, "int8-p48": 0.005, "mod8-p12-sd": 0.02},
        notes=["paper-cosine's claim (b) setup (8 workers, tiny preset, H = 20, inner lr 2e-3 decayed by a cosine over "
               "600 steps, 30 rounds, random, uniform links, schedule live), GASLoC with its defaults, once per "
               "codec and seed; both sides mix the wire forms (symmetric mixing)"]),
    # claim (c) of paper-cosine once per codec: what the bytes saved buy in wall-clock on half-slow-10x links
    "codecs-c": codec_suite(
        "codecs-c", workers=8, base=PAPER_BASE, b={}, seeds=[],
        codecs={"int8": 0.005, "int8-p10": 0.02, "mod4-sd": 0.005},
        c={"inner.inner_steps": 20, "rounds": 30, "eval_every": 1, "inner.lr": 2e-3, "inner.total_steps": 600},
        c_gasloc={"bandwidth_weighted": True, "search.slower_link_ratio": 3.0},
        notes=["paper-cosine's claim (c) (half the links 10x slower, the clock charging a 100M-parameter model's "
               "bytes) with GASLoC once per codec, each run until it reaches DiLoCo's final loss; DiLoCo's "
               "all-reduce is charged clock.bytes_per_param (2: fp16), as in the paper suites"]),
    "codecs-smoke": codec_suite(
        "codecs-smoke", workers=4, base={**PAPER_BASE, "model.seq_len": 32, "data.batch_size": 2,
                                         "data.val_batches": 1, "inner.warmup_steps": 2},
        b={"inner.inner_steps": 3, "rounds": 2, "eval_every": 1}, seeds=[0], codecs={"int4": 0.005, "int8-p10": 0.02},
        c={"inner.inner_steps": 3, "rounds": 2, "eval_every": 1}, c_gasloc={"bandwidth_weighted": True},
        notes=["a plumbing check at toy size; its verdicts say nothing about the codecs"]),
    "hetero": hetero_suite(
        "hetero", base=HETERO_BASE, seeds=[0, 1, 2], gasloc=HETERO_GASLOC, diloco=HETERO_DILOCO,
        notes=["bench/hetero.py's setup on the simulator: 6 workers, 30 vs 3 Mbit, tiny preset, H = 20, 180 s of "
               "virtual time per run, each method's default wire (GASLoC int8 pairs, DiLoCo float16 all-reduce) and "
               "the inner lr decayed over each method's rounds; the live schedule, DiLoCo with hivemind's "
               "matchmaking keyed by epoch; the clock's numbers measured on the bench by bench/hetero_calibrate.py; "
               "three seeds"]),
    "hetero-smoke": hetero_suite(
        "hetero-smoke", base={**HETERO_BASE, "model.seq_len": 32, "data.batch_size": 2, "data.val_batches": 1,
                              "inner.inner_steps": 3, "max_sim_time_s": 30.0},
        seeds=[0], gasloc=HETERO_GASLOC, diloco=HETERO_DILOCO,
        notes=["a plumbing check at toy size; its verdicts say nothing about the claims"]),
    # claim b's settings (H=20, GASLoC C with gamma = eta = 0.7) with one partner per round
    "overlap": overlap_suite(
        "overlap", workers=8, base=OVERLAP_BASE,
        run={"inner.inner_steps": 20, "rounds": 30, "eval_every": 3, "inner.lr": 2e-3, "outer.form": "C",
             "outer.momentum": 0.7, "outer.outer_lr": 0.7},
        notes=["8 workers of the tiny preset; the clock charges messages as a 100M-parameter model in fp16 "
               "(200 MB): 1.65 s per exchange on uniform 1 Gbit links against 6 s of inner steps, 16 s on a slow "
               "(100 Mbit) link"]),
    "overlap-smoke": overlap_suite(
        "overlap-smoke", workers=4,
        base={**OVERLAP_BASE, "model.seq_len": 32, "data.batch_size": 2, "data.val_batches": 1,
              "inner.warmup_steps": 2},
        run={"inner.inner_steps": 3, "rounds": 3, "eval_every": 1},
        notes=["a plumbing check at toy size; its verdicts say nothing about the claims"]),
}
