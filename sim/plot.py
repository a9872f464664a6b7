"""PNGs of validation loss against simulated wall-clock: one run, or a whole suite (one panel per claim)."""
from __future__ import annotations

from pathlib import Path

COLORS = {"gasloc": "tab:red", "diloco": "tab:blue", "noloco": "tab:green", "gossip": "tab:orange",
          "local": "tab:gray"}


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt
    return plt


def _curve(ax, r: dict, label: str, **kw) -> None:
    t = [e["sim_time_s"] / 60 for e in r["evals"]]
    ax.plot(t, [e["val_loss_mean"] for e in r["evals"]], label=label,
            color=COLORS.get(r["config"]["outer"]["algorithm"]), marker=".", markersize=3, **kw)


def _save(fig, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def plot_run(result: dict, path: str) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5), layout="constrained")
    c = result["config"]
    _curve(ax, result, "mean over workers")
    ax.plot([e["sim_time_s"] / 60 for e in result["evals"]], [e["val_loss_avg_model"] for e in result["evals"]],
            label="averaged model", color="black", linestyle="--", linewidth=1)
    ax.set(xlabel="simulated wall-clock (min)", ylabel="validation loss (nats/token)",
           title=f"{c['outer']['algorithm']}, {c['workers']} workers, {c['topology']}, H={c['inner']['inner_steps']}, "
                 f"{c['clock']['profile']}")
    ax.grid(alpha=0.3)
    ax.legend()
    _save(fig, path)
    plt.close(fig)


PANELS = [("a-ring", "(a) H=1, ring"), ("a-random", "(a) H=1, random"), ("b", "(b) H≥20, random, uniform links"),
          ("c", "(c) half the links 10x slower")]


OVERLAP_PANELS = [("uniform", "uniform 1 Gbit links"), ("half-slow-10x", "half the links 10x slower")]


def _panels(report: dict) -> list[tuple[str, str, str]]:
    """(run-name prefix, title, verdict) per panel: the paper's claims, the overlap suite's profiles, the decay
    suite's schedules, or for the other suites (the tuning sweeps) one panel with every run."""
    verdict = {c["claim"]: "not run" if c["passed"] is None else "PASS" if c["passed"] else "FAIL"
               for c in report["claims"]}
    if report["suite"].startswith("overlap"):
        return [(p, t, f"loss {verdict.get('loss-' + p, '?')}, speed {verdict.get('speed-' + p, '?')}")
                for p, t in OVERLAP_PANELS]
    if report["suite"].startswith("decay"):
        scheds = [c["claim"].removeprefix("b-") for c in report["claims"]]
        return [(s, f"(b) lr schedule {s}", verdict[f"b-{s}"]) for s in scheds]
    if any(n.startswith(p + "-") for n in report["runs"] for p, _ in PANELS):
        return [(p, t, verdict.get(p, "")) for p, t in PANELS]
    return [("", "every run", "")]


def plot_suite(report: dict, path: str) -> None:
    plt = _pyplot()
    panels = _panels(report)
    rows = 2 if len(panels) == 4 else 1
    cols = len(panels) // rows
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4.25 * rows), layout="constrained", squeeze=False)
    runs = report["runs"]
    for ax, (claim, title, verdict) in zip(axes.flat, panels):
        mine = {n: r for n, r in runs.items() if not claim or n.startswith(claim + "-")}
        for name, r in mine.items():  # a second run of one method (another inner lr) dashed
            _curve(ax, r, name.removeprefix(claim + "-") if claim else name, linestyle="--" if "-lr" in name else "-")
        if claim == "c" and "c-diloco" in mine:
            d = mine["c-diloco"]
            ax.axhline(d["final_val_loss"], color="tab:blue", linestyle=":", linewidth=1,
                       label="DiLoCo's final loss")
            ax.axvline(0.6 * d["final_sim_time_s"] / 60, color="black", linestyle=":", linewidth=1,
                       label="0.6x DiLoCo's time")
        losses = [e["val_loss_mean"] for r in mine.values() for e in r["evals"][1:]]
        if losses:  # skip the initial loss so the differences at the end stay visible
            lo, hi = min(losses), sorted(losses)[int(0.9 * (len(losses) - 1))]
            ax.set_ylim(lo - 0.05 * (hi - lo), hi + 0.05 * (hi - lo))
        ax.set(title=f"{title}: {verdict}" if verdict else title, xlabel="simulated wall-clock (min)",
               ylabel="val loss, mean over workers")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"gasloc sim compare --suite {report['suite']}")
    _save(fig, path)
    plt.close(fig)


def plot_scale(report: dict, path: str) -> None:
    """The scale suite: validation loss (top) and consensus distance (bottom) over simulated time, one column per
    link profile, one colour per swarm size; GASLoC solid, DiLoCo dashed."""
    plt = _pyplot()
    runs = report["runs"]
    profiles = sorted({r["config"]["clock"]["profile"] for r in runs.values()})
    sizes = sorted({r["config"]["workers"] for r in runs.values()})
    cmap = plt.get_cmap("viridis")
    fig, axes = plt.subplots(2, len(profiles), figsize=(6 * len(profiles), 8), layout="constrained", squeeze=False)
    for col, prof in enumerate(profiles):
        for n, k in enumerate(sizes):
            color = cmap(n / max(1, len(sizes) - 1))
            for algo, style in (("gasloc", "-"), ("diloco", "--")):
                r = runs.get(f"k{k}-{prof}-{algo}")
                if r is None:
                    continue
                # log time axis (GASLoC's runs end in seconds, DiLoCo's 1,000-worker all-reduce takes minutes), so
                # the evaluation at t = 0 is left out
                evals = [e for e in r["evals"] if e["sim_time_s"] > 0]
                t = [e["sim_time_s"] for e in evals]
                label = f"{algo}, K={k}"
                axes[0, col].plot(t, [e["val_loss_mean"] for e in evals], style, color=color, label=label)
                if algo == "gasloc":
                    axes[1, col].plot(t, [e["consensus"] for e in evals], style, color=color, label=label)
        axes[0, col].set(title=f"{prof}: val loss, mean over workers", xlabel="simulated wall-clock (s)",
                         xscale="log")
        axes[1, col].set(title=f"{prof}: GASLoC's consensus distance", xlabel="simulated wall-clock (s)",
                         xscale="log", yscale="log")
        for ax in axes[:, col]:
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(f"gasloc sim compare --suite {report['suite']}")
    _save(fig, path)
    plt.close(fig)
