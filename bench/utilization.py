"""Utilization benchmark (issue 13 item 6): how much of the wall-clock a swarm's peers spend computing, against
the same number of bare training loops run side by side in the same invocation.

For each swarm size N (default 3 and 5: odd on purpose, so every round one peer is left without a partner):
  fixed     bootstrap + N `gasloc peer` processes for `rounds` rounds, swarm.adaptive_deadline = false: a peer
            without a partner searches the full partner_deadline_s
  adaptive  the same with swarm.adaptive_deadline = true (opt-in)
  overlap   the fixed deadline with outer.overlap = true: each round's exchange runs during the next round's
            inner steps (one-round-delayed mixing), so a search costs no compute time at all
and during each of those runs, side by side with it, N bare inner loops (the peer's model, data, AdamW, batch and
torch threads, built from the same peer TOML by the same functions), stepping until the swarm is done: what N
inner loops deliver on this machine at that time (other jobs on a shared machine come and go; running both at
once gives both the same machine).

Figures per run:
  tokens_per_s   the swarm's inner-loop tokens per second: sum over peers of inner-step tokens / (last round end
                 - first round start)
  bare           the bare loops' tokens per second over the same window (steps that ended within it)
  vs_bare        tokens_per_s / bare
  compute_share  per peer, the seconds of its inner steps / its wall-clock from its first round's start to its last
                 round's end (median and minimum over peers)
  wait_share     per peer, partner-search seconds / wall-clock (median)
  ok_share       share of rounds with an ok exchange

On a machine with fewer cores than processes, a peer that waits lends its core to the others, so vs_bare can stay
high while compute_share is low; compute_share is what a peer with its own GPU would lose.

    python bench/utilization.py --json util.json                    # 3 and 5 peers, 15 rounds each mode
    python bench/utilization.py --peers 3 --rounds 10 --modes adaptive
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import click

BENCH_TOML = """\
[model]
preset = "{preset}"
seq_len = {seq_len}
[data]
batch_size = {batch_size}
[inner]
inner_steps = {inner_steps}
[outer]
overlap = {overlap}
[swarm]
run_id = "{run_id}"
adaptive_deadline = {adaptive}
partner_deadline_s = {deadline_s}
[run]
max_rounds = {rounds}
torch_threads = {threads}
device = "cpu"
eval_every_rounds = {no_eval}
"""


MODES = {"fixed": (False, False), "adaptive": (True, False), "overlap": (False, True)}  # (adaptive, overlap)


def write_toml(path: Path, *, mode: str, run_id: str, o: dict) -> Path:
    adaptive, overlap = MODES[mode]
    path.write_text(BENCH_TOML.format(adaptive=str(adaptive).lower(), overlap=str(overlap).lower(), run_id=run_id,
                                      no_eval=o["rounds"] + 1,
                                      **{k: o[k] for k in ("preset", "seq_len", "batch_size", "inner_steps",
                                                           "deadline_s", "rounds", "threads")}))
    return path


def bare_worker(config: Path, out: Path, stop: Path) -> None:
    """The inner loop of one peer without the peer: same config, same builders, no network, no outer step. Warmed
    up by one step, then steps until `stop` appears, writing the wall-clock end time of every step to `out`."""
    import torch

    from gasloc.runtime.procs import die_with_supervisor

    die_with_supervisor()

    from gasloc.peer.config import PeerConfig
    from gasloc.peer.train.data import build_data
    from gasloc.peer.train.inner import make_inner_optimizer, run_inner_phase
    from gasloc.peer.train.model import build_model
    from gasloc.runtime.config import resolve

    cfg = resolve(PeerConfig, config)
    if cfg.run.torch_threads:
        torch.set_num_threads(cfg.run.torch_threads)
    data, tok = build_data(cfg.data, cfg.model.seq_len, worker_seed=str(out))
    model = build_model(cfg.model, tok.vocab_size, seed=cfg.run.seed)
    opt = make_inner_optimizer(model, cfg.inner)
    one = cfg.inner.model_copy(update={"inner_steps": 1})
    run_inner_phase(model, opt, data.next_batch, 0, one)
    out.with_suffix(".ready").touch()
    ends, deadline = [], time.monotonic() + 7200
    while not stop.exists() and time.monotonic() < deadline:
        run_inner_phase(model, opt, data.next_batch, len(ends) + 1, one)
        ends.append(time.time())
    out.write_text(json.dumps({"step_ends": ends}))


def start_bare(sup, run_dir: Path, config: Path, tag: str, n: int) -> tuple[list[str], list[Path], Path]:
    """N bare loops, started and warmed up; they run until the returned stop file is created."""
    from gasloc.runtime.procs import ChildFailed

    outs = [run_dir / f"{tag}-bare-{i}.json" for i in range(n)]
    stop = run_dir / f"{tag}-bare.stop"
    names = [f"{tag}-bare-{i}" for i in range(n)]
    for name, out in zip(names, outs):
        sup.start(name, [sys.executable, str(Path(__file__).resolve()), "bare-worker", "--config", str(config),
                         "--out", str(out), "--stop", str(stop)], run_dir / f"{name}.log")
    deadline = time.monotonic() + 300
    while not all(o.with_suffix(".ready").exists() for o in outs):
        if time.monotonic() > deadline or any(sup.children[m].poll() is not None for m in names):
            raise ChildFailed(f"a bare loop did not get ready; see {run_dir}/{tag}-bare-*.log")
        time.sleep(0.1)
    return names, outs, stop


def bare_rate(outs: list[Path], t0: float, t1: float, tokens_per_step: int) -> float:
    """The bare loops' tokens/s over the swarm's window [t0, t1] (wall clock)."""
    steps = sum(sum(t0 <= t <= t1 for t in json.loads(o.read_text())["step_ends"]) for o in outs)
    return steps * tokens_per_step / (t1 - t0)


def wait_exit(sup, names: list[str], timeout_s: float) -> None:
    from gasloc.runtime.procs import ChildFailed

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        codes = {n: sup.children[n].poll() for n in names}
        if all(c is not None for c in codes.values()):
            bad = {n: c for n, c in codes.items() if c != 0}
            if bad:
                raise ChildFailed(f"exited with {bad}")
            return
        time.sleep(0.5)
    raise ChildFailed(f"{names} still running after {timeout_s:.0f} s")


def run_swarm(sup, run_dir: Path, config: Path, n: int, mode: str, timeout_s: float, tokens_per_step: int) -> dict:
    from gasloc.runtime.procs import gasloc_argv

    loopback = "/ip4/127.0.0.1/tcp/0"
    boot = sup.start(f"{mode}-{n}-boot", gasloc_argv("bootstrap", "--host-maddrs", loopback, "--run-id",
                                                      f"util-{mode}-{n}", "--identity-path",
                                                      str(run_dir / f"{mode}-{n}-boot.key")),
                     run_dir / f"{mode}-{n}-boot.log")
    sup.wait_ready(boot, 90)
    names = [f"{mode}-{n}-peer-{i}" for i in range(n)]
    for name in names:
        sup.start(name, gasloc_argv("peer", "--config", str(config), "--initial-peers", boot.maddrs[0],
                                    "--host-maddrs", loopback, "--run-dir", str(run_dir / name)),
                  run_dir / f"{name}.log")
    for name in names:
        sup.wait_ready(sup.children[name], 150)
    wait_exit(sup, names, timeout_s)
    sup.stop(f"{mode}-{n}-boot")
    peers = []
    for name in names:
        rs = [json.loads(line) for line in (run_dir / name / "metrics.jsonl").read_text().splitlines()]
        rs = [r for r in rs if r.get("event") == "round"]
        start, end = rs[0]["time"] - rs[0]["round_s"], rs[-1]["time"]
        peers.append({"start": start, "end": end, "rounds": len(rs),
                      "compute_s": sum(r["compute_s"] for r in rs), "wait_s": sum(r["wait_s"] for r in rs),
                      "tokens": sum(r["inner_steps"] for r in rs) * tokens_per_step,
                      "ok": sum(r["outcome"] == "ok" for r in rs),
                      "partners": len({r["partner"] for r in rs if r["outcome"] == "ok"})})
    wall = max(p["end"] for p in peers) - min(p["start"] for p in peers)
    shares = [p["compute_s"] / (p["end"] - p["start"]) for p in peers]
    return {"mode": mode, "peers": n, "tokens_per_s": sum(p["tokens"] for p in peers) / wall,
            "compute_share_median": statistics.median(shares), "compute_share_min": min(shares),
            "wait_share_median": statistics.median(p["wait_s"] / (p["end"] - p["start"]) for p in peers),
            "ok_share": sum(p["ok"] for p in peers) / sum(p["rounds"] for p in peers),
            "min_partners": min(p["partners"] for p in peers), "wall_s": wall,
            "window": [min(p["start"] for p in peers), max(p["end"] for p in peers)]}


def format_table(rows: list[dict]) -> str:
    head = (f"{'peers':>5} {'mode':>9} {'tokens/s':>9} {'bare':>7} {'vs bare':>8} {'compute':>8} {'min':>6} "
            f"{'wait':>6} {'ok':>5} {'wall s':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['peers']:>5} {r['mode']:>9} {r['tokens_per_s']:>9.0f} {r['bare_tokens_per_s']:>7.0f} "
                     f"{r['vs_bare']:>8.2f} "
                     f"{r['compute_share_median']:>8.2f} {r['compute_share_min']:>6.2f} "
                     f"{r['wait_share_median']:>6.2f} {r['ok_share']:>5.2f} {r['wall_s']:>7.0f}")
    return "\n".join(lines)


@click.group(invoke_without_command=True)
@click.option("--peers", default="3,5", help="swarm sizes, comma-separated")
@click.option("--rounds", default=15, type=click.IntRange(2), help="rounds per peer in each swarm run")
@click.option("--modes", default="fixed,adaptive,overlap", help="swarm runs, comma-separated: fixed, adaptive, "
              "overlap")
@click.option("--preset", default="tiny")
@click.option("--inner-steps", default=10, type=click.IntRange(1))
@click.option("--batch-size", default=8, type=click.IntRange(1))
@click.option("--seq-len", default=64, type=click.IntRange(8))
@click.option("--threads", default=1, type=click.IntRange(1), help="torch threads per process")
@click.option("--deadline-s", default=10.0, type=click.FloatRange(0.1), help="swarm.partner_deadline_s")
@click.option("--run-dir", type=click.Path(path_type=Path), default=None, help="default: runs/util-<time>")
@click.option("--json", "json_out", type=click.Path(path_type=Path), default=None)
@click.pass_context
def main(ctx, peers, rounds, modes, preset, inner_steps, batch_size, seq_len, threads, deadline_s, run_dir, json_out):
    if ctx.invoked_subcommand is not None:
        return
    from gasloc.runtime.procs import ChildFailed, Supervisor

    try:
        sizes = [int(x) for x in peers.split(",")]
    except ValueError:
        raise click.BadParameter(f"{peers!r} is not a comma-separated list of integers", param_hint="--peers") \
            from None
    mode_list = [m for m in modes.split(",") if m]
    if not sizes or min(sizes) < 2 or any(m not in MODES for m in mode_list) or not mode_list:
        raise click.UsageError(f"--peers takes sizes >= 2; --modes takes {', '.join(MODES)}")
    run_dir = (run_dir or Path("runs") / time.strftime("util-%Y%m%d-%H%M%S")).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    o = dict(preset=preset, seq_len=seq_len, batch_size=batch_size, inner_steps=inner_steps, deadline_s=deadline_s,
             rounds=rounds, threads=threads)
    rows: list[dict] = []
    sup = Supervisor()
    code = 0
    try:
        for n in sizes:
            for m in mode_list:
                cfg = write_toml(run_dir / f"{m}-{n}.toml", mode=m, run_id=f"util-{m}-{n}", o=o)
                # the bare loops run during the swarm run, so both see the same machine (other jobs come and go)
                names, outs, stop = start_bare(sup, run_dir, cfg, f"{m}-{n}", n)
                try:
                    row = run_swarm(sup, run_dir, cfg, n, m, timeout_s=3600, tokens_per_step=batch_size * seq_len)
                finally:
                    stop.touch()
                wait_exit(sup, names, 120)
                row["bare_tokens_per_s"] = bare_rate(outs, *row["window"], batch_size * seq_len)
                row["vs_bare"] = row["tokens_per_s"] / row["bare_tokens_per_s"]
                rows.append(row)
                click.echo(f"N={n} {m}: compute share {row['compute_share_median']:.2f}, "
                           f"vs bare {row['vs_bare']:.2f}", err=True)
    except ChildFailed as e:
        click.echo(f"Error: {e} (logs in {run_dir})", err=True)
        code = 1
    finally:
        sup.stop_all(10.0)
        sup.cleanup()
    click.echo(format_table(rows))
    if json_out is not None:
        json_out.write_text(json.dumps({"settings": o, "rows": rows}, indent=1))
    sys.exit(code)


@main.command("bare-worker", hidden=True)
@click.option("--config", type=click.Path(exists=True, path_type=Path), required=True)
@click.option("--out", type=click.Path(path_type=Path), required=True)
@click.option("--stop", type=click.Path(path_type=Path), required=True)
def bare_cmd(config, out, stop):
    bare_worker(config, out, stop)


if __name__ == "__main__":
    main()
