"""Peak host memory per round of a live peer (issue 13 item 3): two `gasloc peer` processes that exchange every round,
measured from outside, so the same script measures any version of the code (`--code DIR`: a directory whose
`gasloc` is the package to run, put first on the children's PYTHONPATH).

Per round: the peer's peak resident set (Linux VmHWM), read when its round line appears in metrics.jsonl and then
reset (writing 5 to /proc/<pid>/clear_refs), so each figure is the highest RSS within about one round. The peers'
DHT children and p2pd are separate processes and not counted. Round 1 (start-up, first allocations) is left out of
the median.

    python bench/host_memory.py --preset medium --rounds 8 --json mem.json
    python bench/host_memory.py --preset medium --code /path/to/old/checkout-parent --json mem-old.json
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
[run]
max_rounds = {rounds}
torch_threads = 1
device = "cpu"
eval_every_rounds = 1000
"""


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


@click.command()
@click.option("--preset", default="medium")
@click.option("--rounds", default=8, type=click.IntRange(3))
@click.option("--inner-steps", default=2, type=click.IntRange(1))
@click.option("--code", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="directory holding the gasloc package to run (default: this checkout's)")
@click.option("--run-dir", type=click.Path(path_type=Path), default=None)
@click.option("--json", "json_out", type=click.Path(path_type=Path), default=None)
def main(preset, rounds, inner_steps, code, run_dir, json_out):
    from gasloc.runtime.procs import ChildFailed, Supervisor, gasloc_argv

    run_dir = (run_dir or Path("runs") / time.strftime("hostmem-%Y%m%d-%H%M%S")).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = run_dir / "peer.toml"
    cfg.write_text(PEER_TOML.format(preset=preset, rounds=rounds, inner_steps=inner_steps))
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env = {k: v for k, v in env.items() if not k.startswith("GASLOC_")}
    if code is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(code.resolve()), env.get("PYTHONPATH", "")])
    sup = Supervisor()
    loopback = "/ip4/127.0.0.1/tcp/0"
    peaks: dict[str, dict[int, float]] = {}
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
                path = run_dir / n / "metrics.jsonl"
                lines = path.read_text().splitlines() if path.exists() else []
                rs = []
                for line in lines:
                    try:
                        rec = json.loads(line)
                    except ValueError:
                        continue  # a line being written
                    if rec.get("event") == "round":
                        rs.append(rec)
                if len(rs) > seen[n]:
                    hwm = kib(child.pid, "VmHWM")
                    reset_peak(child.pid)
                    if hwm is not None:
                        for r in rs[seen[n]:]:
                            peaks[n][r["round"]] = hwm / 1024
                    seen[n] = len(rs)
            time.sleep(0.05)
        if any(sup.children[n].poll() != 0 for n in names):
            raise ChildFailed(f"a peer failed; see {run_dir}/peer-*.log")
        outcomes = []
        for n in names:
            records = [json.loads(line) for line in (run_dir / n / "metrics.jsonl").read_text().splitlines()]
            outcomes += [r["outcome"] for r in records if r.get("event") == "round"]
    except ChildFailed as e:
        click.echo(f"Error: {e}", err=True)
        sys.exit(1)
    finally:
        sup.stop_all(10.0)
        sup.cleanup()
    per_peer = {n: {"peak_mb_by_round": p, "median_peak_mb": statistics.median(v for r, v in p.items() if r > 1)}
                for n, p in peaks.items()}
    result = {"preset": preset, "code": str(code or "this checkout"), "rounds": rounds,
              "ok_rounds": outcomes.count("ok"), "all_rounds": len(outcomes), "peers": per_peer,
              "median_peak_mb": statistics.median(p["median_peak_mb"] for p in per_peer.values())}
    each = ", ".join(f"{n} {p['median_peak_mb']:.0f}" for n, p in per_peer.items())
    click.echo(f"preset={preset} code={result['code']} ok={result['ok_rounds']}/{result['all_rounds']} "
               f"median per-round peak RSS: {result['median_peak_mb']:.0f} MB ({each})")
    if json_out is not None:
        json_out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
