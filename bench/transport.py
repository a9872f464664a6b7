"""Transport benchmark (issue #5): the pairwise exchange of a 25M / 100M-parameter payload, both ways at once.

Methods, all measured in one run, by two worker processes (bench/transport_worker.py):
  gasloc               our Exchanger (gasloc.peer.transport.exchange) over a hivemind p2pd raw stream
  tcp                  plain asyncio TCP, loop.sock_recv_into straight into preallocated tensors (the ceiling)
  hivemind_raw_stream  hivemind's raw binary stream used as documented (StreamReader.readexactly), no protocol
  hivemind_averager    hivemind's DecentralizedAverager, group of two (moves the same bytes as an exchange)
Links: loopback, and two network namespaces joined by a veth pair shaped with tbf on both ends (docs/hivemind.md §3).
Wires: float32 and float16 for every method; a blockwise codec (int8, int4, ...: protocol/codec.py) for gasloc
alone, checked against tcp's float32 row times the codec's compression ratio (issue 32: >= 0.9x).

    python bench/transport.py --quick --json out.json      # 25M only, loopback + 1 Gbit
    python bench/transport.py --json out.json               # 25M and 100M, loopback + 100 Mbit + 1 Gbit
    python bench/transport.py --sizes 25M --links 100mbit,1gbit --wires float32,int4,int8 --methods gasloc,tcp

Shaped links need root (ip netns, tc). Namespaces, links, the workers and every process they started are removed
afterwards, also on Ctrl+C, SIGTERM or an exception. Prints a table with ratios against tcp and against the averager.
"""
from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import click

from gasloc.runtime.procs import become_subreaper, process_table
from gasloc.runtime.sockets import owned_sockets, remove, subtree

WORKER = Path(__file__).with_name("transport_worker.py")
METHODS = ("gasloc", "tcp", "hivemind_raw_stream", "hivemind_averager")
LINKS = {"loopback": None, "100mbit": ("100mbit", "256kb"), "1gbit": ("1gbit", "1mb")}
WARMUP_LINKS = ("loopback", "1gbit")
CAST_WIRES = ("float32", "float16")   # what every method moves; a blockwise codec is gasloc's alone   # 100mbit: a partner there stays below exchange.fast_link_bytes_per_s


class BenchError(RuntimeError):
    """The benchmark could not run (setup failed, a worker died or reported an error)."""


def sh(*cmd: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise BenchError(f"`{' '.join(cmd)}` failed: {r.stderr.strip()}")


@dataclass
class Netns:
    """Two namespaces <prefix>a / <prefix>b joined by a veth pair, egress shaped with tbf on both ends."""
    prefix: str
    rate: str
    burst: str
    created: bool = False

    @property
    def names(self) -> tuple[str, str]:
        return f"{self.prefix}a", f"{self.prefix}b"

    hosts = ("10.213.7.1", "10.213.7.2")

    def up(self) -> None:
        a, b = self.names
        self.created = True      # from the first command on, down() must clean up whatever exists
        sh("ip", "netns", "add", a)
        sh("ip", "netns", "add", b)
        sh("ip", "link", "add", f"{a}v", "type", "veth", "peer", "name", f"{b}v")
        for ns, host in zip((a, b), self.hosts):
            sh("ip", "link", "set", f"{ns}v", "netns", ns)
            sh("ip", "-n", ns, "addr", "add", f"{host}/24", "dev", f"{ns}v")
            sh("ip", "-n", ns, "link", "set", f"{ns}v", "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            # egress shaping on both ends: a's upload and b's upload (tbf is what this kernel has; no netem)
            sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", f"{ns}v", "root", "tbf", "rate", self.rate,
               "burst", self.burst, "latency", "200ms")

    def down(self) -> None:
        if not self.created:
            return
        for ns in self.names:        # deleting a namespace also deletes its end of the veth (and so the pair)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.created = False


class WorkerProc:
    """A worker subprocess in its own process group (so p2pd, DHT and averager children die with it)."""

    def __init__(self, role: str, host: str, netns: str | None, extra: list[str], log_dir: str):
        cmd = [sys.executable, str(WORKER), "--role", role, "--host", host, *extra]
        if netns:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        self.log_path = os.path.join(log_dir, f"worker_{role}_{netns or 'root'}.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     start_new_session=True, cwd=Path(__file__).resolve().parents[1])
        self.role = role

    def send(self, **cmd) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def recv(self, timeout: float) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            tail = Path(self.log_path).read_text()[-3000:]
            raise BenchError(f"worker {self.role} gave no answer within {timeout:.0f} s "
                             f"(rc={self.proc.poll()}); its log ends with:\n{tail}")
        msg = json.loads(line)
        if "error" in msg:
            raise BenchError(f"worker {self.role}: {msg['error']}")
        return msg

    def call(self, timeout: float, **cmd) -> dict:
        self.send(**cmd)
        return self.recv(timeout)

    def stop(self, graceful_s: float) -> None:
        """Ask the worker to exit (it shuts its DHT and p2pd down), then kill its process group regardless."""
        if self.proc.poll() is None:
            try:
                self.send(op="exit")
                self.proc.wait(timeout=graceful_s)
            except (BrokenPipeError, subprocess.TimeoutExpired, OSError):
                pass   # it is killed below either way
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)     # p2pd, DHT and averager children too
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.log.close()


def reap_descendants(timeout_s: float) -> None:
    """Kill and reap every child we still have. main() made us a subreaper, so each orphaned descendant of a worker
    (its DHT and averager processes, their p2pd) became our child when its parent died, whatever process group or
    session it had moved to: once this returns, nothing the workers started runs. (A wait for each worker's process
    group came before this; after it, CI once still found a worker process alive, which that wait cannot explain.)

    Except torch's shared-memory manager (hivemind shares tensors through /dev/shm): it runs in a session of its own
    and removes its files and exits 2 s after its last client is gone; killed, it would leave them behind. It gets
    until the deadline."""
    me, deadline = os.getpid(), time.monotonic() + timeout_s
    while kids := [st for st in process_table().values() if st.ppid == me]:
        late = time.monotonic() > deadline
        for st in kids:
            if st.state not in ("Z", "X") and (st.comm != SHM_MANAGER or late):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(st.pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(st.pid, os.WNOHANG)
        if late:
            # a SIGKILLed process in uninterruptible I/O goes only when that I/O ends (a loaded CI disk)
            print(f"{len(kids)} process(es) still there after {timeout_s:.0f} s (killed now): "
                  + ", ".join(f"{st.pid} ({st.comm}, state {st.state})" for st in kids), file=sys.stderr)
            return
        time.sleep(0.05)


SHM_MANAGER = "torch_shm_manag"   # torch_shm_manager as /proc names it (15 characters)
DESCENDANTS_GONE_S = 30.0


def group_cpu_s(pgids: list[int]) -> dict[str, float]:
    """CPU seconds used so far by the live processes of some process groups (workers with their p2pd, DHT and
    averager children), by kind: "p2pd" or "python"."""
    out = {"p2pd": 0.0, "python": 0.0}
    for st in process_table().values():
        if st.pgid in pgids:
            out["p2pd" if st.comm == "p2pd" else "python"] += st.cpu_s
    return out


# how a payload of N parameters splits into the workers' tensors: ten equal ones, or half of it in the first (a
# language model's embedding, which a pipelined exchange encodes before anything else goes out) and nine after it
LAYOUTS = {"even": lambda n: [n // 10] * 10, "embedding": lambda n: [n // 2] + [n // 18] * 9}


def wire_bytes(sizes: list[int], wire: str) -> int:
    from gasloc.protocol.codec import parse
    return parse(wire).payload_bytes(sizes)


def payload_timeout(sizes: list[int], wire: str, link: str) -> float:
    mb = wire_bytes(sizes, wire) / 1e6
    rate_mb_s = {"loopback": 50, "1gbit": 60, "100mbit": 6}[link]   # pessimistic rates: only a hang should hit it
    return 120 + mb / rate_mb_s * 3


def run_link(link: str, sizes: list[int], wires: list[str], methods: list[str], reps: int, warmup: int,
             log_dir: str, worker_flags: list[str], layout: str = "even") -> list[dict]:
    rows: list[dict] = []
    netns = None
    workers: list[WorkerProc] = []
    try:
        if LINKS[link] is None:
            hosts, spaces = ("127.0.0.1", "127.0.0.1"), (None, None)
        else:
            netns = Netns(f"gxb{os.getpid() % 100000}", *LINKS[link])
            netns.up()
            hosts, spaces = netns.hosts, netns.names
        with_dht = ["--with-dht"] if "hivemind_averager" in methods else []
        a = WorkerProc("a", hosts[0], spaces[0], with_dht + worker_flags, log_dir)
        workers.append(a)
        ready_a = a.recv(120)["ready"]
        extra_b = ["--peer-host", hosts[0], "--peer-tcp", str(ready_a["tcp_port"]), "--peer-maddr", ready_a["maddr"],
                   *worker_flags]
        if with_dht:
            extra_b += [*with_dht, "--peer-dht", *ready_a["dht_maddrs"]]
        b = WorkerProc("b", hosts[1], spaces[1], extra_b, log_dir)
        workers.append(b)
        b.recv(120)
        for params in sizes:
            shapes = LAYOUTS[layout](params)
            for wire in wires:
                timeout = payload_timeout(shapes, wire, link)
                # a blockwise codec is the exchange's own: the other methods have nothing to compare it with
                cell = [m for m in methods if wire in CAST_WIRES or m == "gasloc"]
                for m in cell:
                    key = f"{params}_{wire}_{m}"
                    for w in (a, b):
                        w.call(timeout, op="prepare", key=key, method=m, sizes=shapes, wire=wire)
                times: dict[str, list[float]] = {m: [] for m in cell}
                cpus: dict[str, list[float]] = {m: [] for m in cell}
                cpus_p2pd: dict[str, list[float]] = {m: [] for m in cell}
                for rep in range(warmup + reps):
                    for m in cell:      # interleaved, so a burst of load from elsewhere hits every method
                        key = f"{params}_{wire}_{m}"
                        for w in (a, b):       # both at once: averagers arm only together (matchmaking)
                            w.send(op="arm", key=key)
                        a.recv(timeout), b.recv(timeout)
                        cpu0 = group_cpu_s([a.proc.pid, b.proc.pid])
                        a.send(op="go", key=key)
                        b.send(op="go", key=key)
                        ra, rb = a.recv(timeout), b.recv(timeout)
                        cpu1 = group_cpu_s([a.proc.pid, b.proc.pid])
                        cpu_p2pd = cpu1["p2pd"] - cpu0["p2pd"]
                        cpu = cpu_p2pd + cpu1["python"] - cpu0["python"]
                        if ra["check"] != "ok" or rb["check"] != "ok":
                            raise BenchError(f"{m} {params} {wire} {link}: received data differs "
                                             f"(a: {ra['check']}, b: {rb['check']})")
                        seconds = max(ra["seconds"], rb["seconds"]) if m == "hivemind_averager" else rb["seconds"]
                        if rep >= warmup:
                            times[m].append(seconds)
                            cpus[m].append(cpu)
                            cpus_p2pd[m].append(cpu_p2pd)
                        print(f"  {link:8} {params / 1e6:5.0f}M {wire:8} {m:20} rep {rep - warmup:+d}: "
                              f"{seconds:7.3f} s  cpu {cpu:6.2f} s (p2pd {cpu_p2pd:.2f})", flush=True)
                for m in cell:
                    key = f"{params}_{wire}_{m}"
                    for w in (a, b):
                        w.call(60, op="drop", key=key)
                    wire_mb = wire_bytes(shapes, wire) / 1e6
                    med = statistics.median(times[m])
                    rows.append({"link": link, "params": params, "layout": layout, "wire_dtype": wire, "method": m,
                                 "seconds": med,
                                 "seconds_min": min(times[m]), "runs": times[m], "wire_mb_each_way": wire_mb,
                                 "cpu_s": statistics.median(cpus[m]), "cpu_p2pd_s": statistics.median(cpus_p2pd[m]),
                                 "mb_s_each_way": wire_mb / med})
    finally:
        # hivemind leaves DHT/averager socket files behind: note ours while their owners live, remove them after
        sockets = owned_sockets(set().union(*(subtree(w.proc.pid) for w in workers)))
        failing = sys.exc_info()[0] is not None      # interrupted or failed: do not wait long for a busy worker
        for w in workers:
            w.stop(graceful_s=2 if failing else 15)
        reap_descendants(DESCENDANTS_GONE_S)
        remove(sockets)
        if netns is not None:
            netns.down()
    return rows


def table(rows: list[dict]) -> str:
    by_key = {(r["link"], r["params"], r["wire_dtype"], r["method"]): r for r in rows}
    lines = [f"{'link':9} {'params':>7} {'wire':9} {'method':20} {'median s':>9} {'min s':>7} {'MB/s each way':>14} "
             f"{'vs tcp':>7} {'vs averager':>11} {'CPU s':>6} {'p2pd':>5}"]
    for r in rows:
        k = (r["link"], r["params"], r["wire_dtype"])
        tcp, avg = by_key.get((*k, "tcp")), by_key.get((*k, "hivemind_averager"))
        # a ratio is speed relative to the reference: >1 means faster than it
        vs_tcp = f"{tcp['seconds'] / r['seconds']:.2f}x" if tcp else "-"
        vs_avg = f"{avg['seconds'] / r['seconds']:.2f}x" if avg else "-"
        lines.append(f"{r['link']:9} {r['params'] / 1e6:6.0f}M {r['wire_dtype']:9} {r['method']:20} "
                     f"{r['seconds']:9.3f} {r['seconds_min']:7.3f} {r['mb_s_each_way']:14.1f} {vs_tcp:>7} "
                     f"{vs_avg:>11} {r['cpu_s']:6.2f} {r['cpu_p2pd_s']:5.2f}")
    return "\n".join(lines)


def targets(rows: list[dict]) -> list[str]:
    """The issues' targets: on the fp32 rows >= 0.9x tcp on shaped links, >= 2x averager on loopback; a codec's
    exchange delivers >= 0.9x the parameters a second of tcp's fp32 row times the codec's compression ratio."""
    by_key = {(r["link"], r["params"], r["wire_dtype"], r["method"]): r for r in rows}
    out = []
    for (link, params, wire, method), r in sorted(by_key.items()):
        if method != "gasloc":
            continue
        if wire not in CAST_WIRES:
            ref = by_key.get((link, params, "float32", "tcp"))
            if ref and link != "loopback":
                compression = 4 * params / (r["wire_mb_each_way"] * 1e6)
                ratio = ref["seconds"] / r["seconds"] / compression   # params/s against tcp's x compression
                out.append(f"{link} {params / 1e6:.0f}M {wire}: gasloc = {ratio:.2f}x tcp float32 x {compression:.2f} "
                           f"(compression) (target >= 0.9x): {'MET' if ratio >= 0.9 else 'NOT MET'}")
            continue
        ref_m, goal = ("hivemind_averager", 2.0) if link == "loopback" else ("tcp", 0.9)
        ref = by_key.get((link, params, wire, ref_m))
        if ref:
            ratio = ref["seconds"] / r["seconds"]
            out.append(f"{link} {params / 1e6:.0f}M {wire}: gasloc = {ratio:.2f}x {ref_m} (target >= {goal}x): "
                       f"{'MET' if ratio >= goal else 'NOT MET'}")
    return out


def parse_size(s: str) -> int:
    s = s.strip().upper()
    return int(float(s[:-1]) * 1e6) if s.endswith("M") else int(s)


@click.command()
@click.option("--sizes", default="25M,100M", show_default=True, help="payload sizes in parameters (10 tensors each)")
@click.option("--links", default="loopback,100mbit,1gbit", show_default=True,
              help=f"comma-separated, from: {', '.join(LINKS)}")
@click.option("--wires", default="float32,float16", show_default=True, help="float32, float16 (every method) or a "
              "dense blockwise codec such as int4, int8 (gasloc only, against tcp's float32 row)")
@click.option("--methods", default=",".join(METHODS), show_default=True, help="comma-separated subset of methods")
@click.option("--reps", default=3, show_default=True, help="timed repetitions per cell (the median is reported)")
@click.option("--warmup", default=1, show_default=True,
              help="untimed runs per cell on loopback and 1gbit (page faults; the stream count gasloc learns from "
                   "its first exchange with a partner); none on 100mbit, where they cost most and teach nothing")
@click.option("--quick", is_flag=True, help="25M only, loopback + 1gbit, 2 reps")
@click.option("--uvloop/--asyncio", default=True, show_default=True,
              help="the workers' event loops: uvloop, which the peer's daemon runs (runtime/aio.py), or asyncio's own")
@click.option("--max-streams", default=32, show_default=True, help="gasloc: parallel streams per exchange")
@click.option("--layout", type=click.Choice(sorted(LAYOUTS)), default="even", show_default=True,
              help="the payload's tensors: ten equal ones, or half of the parameters in the first (an embedding)")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, writable=True), help="write the rows here")
def main(sizes, links, wires, methods, reps, warmup, quick, uvloop, max_streams, layout, json_out) -> None:
    if quick:
        sizes, links, reps = "25M", "loopback,1gbit", 2
    try:
        size_list = [parse_size(s) for s in sizes.split(",")]
    except ValueError:
        raise click.UsageError(f"--sizes {sizes!r}: use numbers like 25M,100M") from None
    link_list, wire_list, method_list = links.split(","), wires.split(","), methods.split(",")
    for name, got, allowed in (("--links", link_list, LINKS), ("--methods", method_list, METHODS)):
        bad = [x for x in got if x not in allowed]
        if bad:
            raise click.UsageError(f"{name}: unknown {bad}; choose from {', '.join(allowed)}")
    from gasloc.protocol.codec import CodecError, parse
    for w in wire_list:
        try:
            c = parse(w)
        except CodecError as e:
            raise click.UsageError(f"--wires: {e}") from None
        if c.sparse or (c.cast is not None and w not in CAST_WIRES):
            raise click.UsageError(f"--wires: {w} is not benchmarked here (float32, float16 or a dense int codec)")
    if any(LINKS[link] for link in link_list) and os.geteuid() != 0:
        raise click.UsageError("shaped links need root (ip netns, tc); run as root or use --links loopback")

    # SIGTERM/SIGHUP unwind like Ctrl+C so every finally (workers, namespaces) runs
    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGHUP, interrupt)
    become_subreaper()     # orphaned worker descendants become our children, so run_link can reap every one

    rows: list[dict] = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gxbench-") as log_dir:
        try:
            for link in link_list:
                rows += run_link(link, size_list, wire_list, method_list, reps,
                                 warmup if link in WARMUP_LINKS else 0, log_dir,
                                 ["--max-streams", str(max_streams)] + (["--uvloop"] if uvloop else []), layout)
        except BenchError as e:
            raise click.ClickException(str(e)) from None
        except KeyboardInterrupt:
            click.echo("interrupted; workers and namespaces removed", err=True)
            sys.exit(130)
    click.echo(table(rows))
    for line in targets(rows):
        click.echo(line)
    click.echo(f"total {time.monotonic() - t0:.0f} s")
    if json_out:
        Path(json_out).write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
