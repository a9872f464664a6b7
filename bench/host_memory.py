"""Peak host memory per round of a live peer, in parameter copies (issue 13 item 3, issue 31 item 1): two `gasloc peer`
processes that exchange every round, run once per preset (default `small`, then `medium`), measured so the same
script measures any version of the code (`--code DIR`: a directory whose `gasloc` is the package to run, put first on
the children's PYTHONPATH).

Per round: the peer's peak resident set. Code that reports it per round (its start event says
peak_mem_per_round: VmHWM reset at each round's start) is read from its round records; older code is measured from
outside (Linux VmHWM, read when the round line appears in metrics.jsonl and then reset by writing 5 to
/proc/<pid>/clear_refs). The peers' DHT children and p2pd are separate processes and not counted. Round 1 (start-up,
first allocations) is left out of the median.

In parameter copies: (median peak of the larger preset - that of the smaller) / (4 bytes x the difference in
parameters), so the runtime's constant (torch, hivemind, the tokenizer: ~0.5 GB) cancels. The exchange's own
buffers (peer/transport/staging.py: the decoded received tensors, and with a lossy codec the two payloads and the
decoded copy of our own wire form) are counted from the codec the peers ran with and reported beside the total.

    python bench/host_memory.py --json mem.json                                   # small and medium, this code
    python bench/host_memory.py --code /path/to/old/checkout-parent --json old.json
    python bench/host_memory.py --codec float32                                   # a lossless wire
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import click

PEER_TOML = """\
[model]
preset = "{preset}"
seq_len = 64
[data]
batch_size = 1
[inner]
inner_steps = {inner_steps}
[swarm]
run_id = "hostmem"
{exchange}[run]
max_rounds = {rounds}
torch_threads = 1
device = "cpu"
eval_every_rounds = 1000
{compact}"""


def kib(pid: int, field: str) -> int | None:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def reset_peak(pid: int) -> None:
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass


def exchange_copies(codec_name: str | None, numels: list[int]) -> float:
    """The exchange's buffers on the host in parameter copies, for a peer that ran `codec_name` (None: code older
    than codecs, a float32 wire whose receive buffer is the one buffer)."""
    if codec_name is None:
        return 1.0
    from gasloc.protocol.codec import parse

    c = parse(codec_name)
    n4 = 4 * sum(numels)
    decoded = 1.0  # the received tensors, decoded (recycled round to round)
    if c.cast is not None and c.cast.itemsize == 4:
        return decoded  # float32 on an fp32 model: zero-copy send, the receive buffer is the tensors
    payloads = 2 * c.payload_bytes(numels) / n4  # ours encoded, theirs received
    # the decoded copy of our own wire form (symmetric mixing); none where the codec mixes against our tensors
    own = 0.0 if c.lossless or getattr(c, "modulo", False) else 1.0
    return decoded + payloads + own


def run_preset(preset: str, rounds: int, inner_steps: int, codec: str | None, env: dict, run_dir: Path,
               compact: bool = False) -> dict:
    from gasloc.runtime.procs import ChildFailed, Supervisor, gasloc_argv

    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = run_dir / "peer.toml"
    cfg.write_text(PEER_TOML.format(preset=preset, rounds=rounds, inner_steps=inner_steps,
                                    exchange="" if codec is None else f'[exchange]\ncodec = "{codec}"\n',
                                    compact="compact_host_heap = true\n" if compact else ""))
    sup = Supervisor()
    loopback = "/ip4/127.0.0.1/tcp/0"
    peaks: dict[str, dict[int, float]] = {}  # bytes
    try:
        boot = sup.start("boot", gasloc_argv("bootstrap", "--host-maddrs", loopback, "--run-id", "hostmem",
                                             "--identity-path", str(run_dir / "boot.key")),
                         run_dir / "boot.log", env=env)
        sup.wait_ready(boot, 90)
        names = ["peer-0", "peer-1"]
        for n in names:
            sup.start(n, gasloc_argv("peer", "--config", str(cfg), "--initial-peers", boot.maddrs[0],
                                     "--host-maddrs", loopback, "--run-dir", str(run_dir / n)), run_dir / f"{n}.log",
                      env=env)
        for n in names:
            sup.wait_ready(sup.children[n], 300)
            peaks[n] = {}
            reset_peak(sup.children[n].pid)
        seen = dict.fromkeys(names, 0)
        deadline = time.monotonic() + 3600
        while any(sup.children[n].poll() is None for n in names) and time.monotonic() < deadline:
            for n in names:
                child = sup.children[n]
                rs = [r for r in records(run_dir / n) if r.get("event") == "round"]
                if len(rs) > seen[n]:
                    hwm = kib(child.pid, "VmHWM")
                    reset_peak(child.pid)
                    if hwm is not None:
                        for r in rs[seen[n]:]:
                            peaks[n][r["round"]] = hwm * 1024
                    seen[n] = len(rs)
            time.sleep(0.05)
        if any(sup.children[n].poll() != 0 for n in names):
            raise ChildFailed(f"a peer failed; see {run_dir}/peer-*.log")
    finally:
        sup.stop_all(10.0)
        sup.cleanup()
    per_peer, outcomes, start = {}, [], {}
    for n in names:
        recs = records(run_dir / n)
        start = next(r for r in recs if r.get("event") == "start")
        rs = [r for r in recs if r.get("event") == "round"]
        outcomes += [r["outcome"] for r in rs]
        if start.get("peak_mem_per_round"):  # the peer's own per-round figure (MB = 10^6 B)
            p = {r["round"]: r["peak_mem_mb"] * 1e6 for r in rs}
            source = "round records (peak_mem_mb)"
        else:
            p = peaks[n]
            source = "outside (VmHWM, reset per round line)"
        later = [v for r, v in p.items() if r > 1]
        per_peer[n] = {"peak_bytes_by_round": p, "median_peak_bytes": statistics.median(later),
                       "max_peak_bytes": max(later)}
    return {"preset": preset, "num_params": start.get("num_params"), "codec": start.get("codec"), "source": source,
            "ok_rounds": outcomes.count("ok"), "all_rounds": len(outcomes), "peers": per_peer,
            "median_peak_bytes": statistics.median(p["median_peak_bytes"] for p in per_peer.values()),
            "max_peak_bytes": max(p["max_peak_bytes"] for p in per_peer.values())}


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    out = []
    for line in (path.read_text().splitlines() if path.exists() else []):
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line being written
    return out


@click.command()
@click.option("--presets", default="small,medium", help="two presets, smaller first (comma-separated)")
@click.option("--rounds", default=8, type=click.IntRange(3))
@click.option("--inner-steps", default=2, type=click.IntRange(1))
@click.option("--codec", default=None, help="[exchange] codec of the peers (default: the code's default)")
@click.option("--code", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="directory holding the gasloc package to run (default: this checkout's)")
@click.option("--compact-host-heap", is_flag=True, help="the peers set run.compact_host_heap (glibc's mmap "
              "threshold: ~1.3 copies less, inner steps ~50 % slower on the CPU)")
@click.option("--run-dir", type=click.Path(path_type=Path), default=None)
@click.option("--json", "json_out", type=click.Path(path_type=Path), default=None)
def main(presets, rounds, inner_steps, codec, code, compact_host_heap, run_dir, json_out):
    from gasloc.runtime.procs import ChildFailed

    names = [p.strip() for p in presets.split(",") if p.strip()]
    if len(names) != 2:
        raise click.BadParameter("give two presets, e.g. small,medium", param_hint="--presets")
    run_dir = (run_dir or Path("runs") / time.strftime("hostmem-%Y%m%d-%H%M%S")).resolve()
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env = {k: v for k, v in env.items() if not k.startswith("GASLOC_")}
    if code is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(code.resolve()), env.get("PYTHONPATH", "")])
    try:
        runs = [run_preset(p, rounds, inner_steps, codec, env, run_dir / p, compact_host_heap) for p in names]
    except ChildFailed as e:
        click.echo(f"Error: {e}", err=True)
        sys.exit(1)
    small, big = runs
    dn = big["num_params"] - small["num_params"]
    copies = (big["median_peak_bytes"] - small["median_peak_bytes"]) / (4 * dn)
    import torch

    from gasloc.peer.train.model import LlamaLM, ModelConfig

    with torch.device("meta"):
        shapes = {p: [t.numel() for t in LlamaLM(ModelConfig(preset=p, seq_len=64), 256).parameters()]
                  for p in names}
    ex_small, ex_big = (exchange_copies(r["codec"], shapes[r["preset"]]) for r in runs)
    # the exchange's copies, as copies of the difference (both presets run the same codec)
    exchange = (ex_big * sum(shapes[names[1]]) - ex_small * sum(shapes[names[0]])) / dn
    result = {"code": str(code or "this checkout"), "rounds": rounds, "codec": big["codec"],
              "compact_host_heap": compact_host_heap, "runs": runs,
              "peak_copies": copies, "exchange_copies": exchange, "training_copies": copies - exchange}
    for r in runs:
        each = ", ".join(f"{n} {p['median_peak_bytes'] / 1e6:.0f}" for n, p in r["peers"].items())
        click.echo(f"preset={r['preset']} params={r['num_params']} ok={r['ok_rounds']}/{r['all_rounds']} median "
                   f"per-round peak RSS: {r['median_peak_bytes'] / 1e6:.0f} MB ({each}; the highest round "
                   f"{r['max_peak_bytes'] / 1e6:.0f}; from {r['source']})")
    click.echo(f"code={result['code']} codec={big['codec'] or 'float32 (no codecs yet)'}: peak per round "
               f"{copies:.1f} parameter copies, of which the exchange's buffers {exchange:.1f}, the rest "
               f"{copies - exchange:.1f}")
    if json_out is not None:
        json_out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
