"""Soak benchmark (issue 14 item 4): N real `gasloc peer` processes on loopback (tiny model) for M minutes under a
seeded fault schedule, then the figures that long runs of hivemind swarms are known to fail on.

Every ~--fault-every-s seconds (jittered +-20 %, seeded) one fault; each four faults are the four kinds in a seeded
order:
  kill9     kill -9 of a peer's main process, restart in the same run dir (it should resume from its checkpoint)
  sigstop   SIGSTOP of a peer's whole tree (p2pd included) for --stop-s seconds, then SIGCONT
  joiner    a new peer with a fresh run dir (it should download the swarm's state); with two joiners running,
            the older one leaves first (SIGTERM), so the swarm stays near its size
  sigterm   a clean leave (SIGTERM), then a rejoin in the same run dir (it should resume)
Victims are drawn from the peers other than p0 and p1: those two run untouched from start to end, so the RSS and
fd growth of at least two processes is always measured over the whole run (a restart starts a new process).

Recorded: every round event of every process (metrics.jsonl), RSS and open fds of every peer's main process every
5 s, each fault's time. Reported (bench/soak_report.py): exchanges past their deadline, non-finite values, the
swarm's validation loss after the first sixth of the run vs its last sixth, orphan processes and leftover sockets
once everything stopped, per-process RSS growth (last sixth vs the second sixth: minutes 25-30 vs 5-10 at 30 min)
and fd growth, restarts that resumed vs re-joined.

    python bench/soak.py                                 # 6 peers, 30 min
    python bench/soak.py --minutes 3 --json soak.json --png soak.png

Nothing is left running afterwards, also on Ctrl+C (the supervisor stops every tree; kill -9'd processes' socket
files are removed).
"""
from __future__ import annotations

import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak_report import Incarnation, analyse, format_table  # noqa: E402  (bench/ is scripts, not a package)

from gasloc.runtime.jsonl import read_jsonl  # noqa: E402
from gasloc.runtime.procs import Supervisor, gasloc_argv  # noqa: E402

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
RUN_ID = "soak"
EXCHANGE_TIMEOUT_S = 2.5
GRACE_S = 0.5  # past the deadline by more than this: the exchange ignored it (scheduling jitter below it)
STEADY = ("p0", "p1")
MAX_JOINERS = 2
FAULTS = ("kill9", "sigstop", "joiner", "sigterm")
PEER_TOML = f"""
[model]
preset = "tiny"
seq_len = 64
[data]
batch_size = 4
val_batches = 2
[inner]
inner_steps = 20
warmup_steps = 10
lr = 0.002
[exchange]
exchange_timeout_s = {EXCHANGE_TIMEOUT_S}
accept_timeout_s = 1.0
[swarm]
run_id = "{RUN_ID}"
announce_ttl_s = 6.0
partner_deadline_s = 1.5
min_backoff_s = 3.0
max_backoff_s = 8.0
[checkpoint]
every_rounds = 5
[run]
eval_every_rounds = 3
"""


def rss_and_fds(pid: int) -> tuple[float, int] | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
        return float(rss), len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration):
        return None


class Soak:
    def __init__(self, run_dir: Path, peers: int, seed: int, stop_s: float):
        self.run_dir, self.n, self.rng, self.stop_s = run_dir, peers, random.Random(seed), stop_s
        self.sup = Supervisor()
        self.config = run_dir / "peer.toml"
        self.config.write_text(PEER_TOML)
        self.incs: dict[str, Incarnation] = {}   # supervisor name -> incarnation
        self.current: dict[str, str] = {}        # peer -> its current incarnation's name
        self.faults: list[dict] = []
        self.boot: list[str] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self._joiners = 0
        self._deck: list[str] = []

    def start_bootstrap(self) -> None:
        d = self.run_dir / "bootstrap"
        child = self.sup.start("bootstrap", gasloc_argv(
            "bootstrap", "--host-maddrs", LOOPBACK, "--identity-path", str(d / "identity.key"), "--run-id", RUN_ID),
            d / "bootstrap.log", env=self._env())
        self.boot = self.sup.wait_ready(child, 60)["maddrs"]

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GASLOC_")}
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", GASLOC_LOG_LEVEL="INFO")
        return env

    def start_peer(self, peer: str, why: str, wait: bool = True) -> str:
        k = sum(1 for i in self.incs.values() if i.peer == peer) + 1
        name = peer if k == 1 else f"{peer}#{k}"
        d = self.run_dir / peer
        child = self.sup.start(name, gasloc_argv(
            "peer", "--config", str(self.config), "--initial-peers", self.boot[0], "--host-maddrs", LOOPBACK,
            "--run-dir", str(d)), d / f"peer-{k}.log", env=self._env())
        with self.lock:
            self.incs[name] = Incarnation(peer=peer, name=name, started=time.time(), why=why)
            self.current[peer] = name
        if wait:
            self.sup.wait_ready(child, 180)
        return name

    def sample(self) -> None:
        """RSS and fds of every running peer's main process, every 5 s."""
        while not self.stop.wait(5.0):
            with self.lock:
                live = [(self.incs[n], self.sup.children[n]) for n in self.current.values() if n in self.sup.children]
            for inc, child in live:
                if child.poll() is None:
                    got = rss_and_fds(child.pid)
                    if got is not None:
                        inc.mem.append((time.time(), got[0], got[1]))

    def next_kind(self) -> str:
        """Every kind once per four faults, in a seeded order: a 3-minute run (5 faults) sees each of them."""
        if not self._deck:
            self._deck = self.rng.sample(FAULTS, len(FAULTS))
        return self._deck.pop()

    def victims(self) -> list[str]:
        return sorted(p for p, n in self.current.items() if p not in STEADY and self.sup.children[n].poll() is None)

    def fault(self, kind: str) -> dict:
        rec = {"time": time.time(), "kind": kind}
        if kind == "joiner":
            # the swarm stays near its size on shared cores: with MAX_JOINERS joiners running, the oldest leaves
            running = sorted((p for p in self.victims() if p.startswith("j")), key=lambda p: int(p[1:]))
            if len(running) >= MAX_JOINERS:
                rec["left"] = running[0]
                self.sup.stop(self.current[running[0]], 30)
                del self.current[running[0]]
            self._joiners += 1
            peer = f"j{self._joiners}"
            rec["peer"] = peer
            self.start_peer(peer, "joiner", wait=False)
            return rec
        peer = self.rng.choice(self.victims())
        name = self.current[peer]
        rec["peer"] = peer
        if kind == "kill9":
            self.incs[name].hard_killed = True
            self.sup.children[name].signal(signal.SIGKILL)
            self.sup.stop(name, 10)  # waits for its tree (DHT fork, p2pd) to follow
            self.start_peer(peer, "restart-after-kill9", wait=False)
        elif kind == "sigterm":
            rec["exit_code"] = self.sup.stop(name, 30)
            self.start_peer(peer, "rejoin-after-sigterm", wait=False)
        else:
            self.sup.signal_tree(name, signal.SIGSTOP)
            threading.Timer(self.stop_s, lambda: self.sup.signal_tree(name, signal.SIGCONT)).start()
        return rec

    def collect(self) -> list[Incarnation]:
        """Each incarnation's events: its metrics.jsonl lines between its start and the next incarnation's."""
        by_peer: dict[str, list[Incarnation]] = {}
        for inc in self.incs.values():
            by_peer.setdefault(inc.peer, []).append(inc)
        for peer, incs in by_peer.items():
            events = read_jsonl(self.run_dir / peer / "metrics.jsonl")
            incs.sort(key=lambda i: i.started)
            for i, inc in enumerate(incs):
                hi = incs[i + 1].started if i + 1 < len(incs) else float("inf")
                mine = [e for e in events if inc.started <= e.get("time", 0) < hi]
                inc.rounds = [e for e in mine if e.get("event") == "round"]
                inc.starts = [e for e in mine if e.get("event") == "start"]
        return list(self.incs.values())


def plot(incs: list[Incarnation], res: dict, t0: float, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    colors = {}
    for inc in sorted(incs, key=lambda i: i.started):
        c = colors.setdefault(inc.peer, f"C{len(colors) % 10}")
        pts = [((r["time"] - t0) / 60, r["val_loss"]) for r in inc.rounds if r.get("val_loss") is not None]
        if pts:
            ax1.plot(*zip(*pts), ".", ms=3, color=c, alpha=0.5)
        if inc.mem:
            ax2.plot([(t - t0) / 60 for t, _, _ in inc.mem], [m / 1e6 for _, m, _ in inc.mem], color=c,
                     label=inc.peer if inc.name == inc.peer else None)
    if res["val_loss_curve"]:
        ax1.plot(*zip(*res["val_loss_curve"]), "k-", lw=2, label="swarm mean")
    for f in res["faults"]:
        for ax in (ax1, ax2):
            ax.axvline((f["time"] - t0) / 60, color="grey", lw=0.6, ls=":")
        ax1.text((f["time"] - t0) / 60, ax1.get_ylim()[1], f"{f['kind']} {f['peer']}", rotation=90, fontsize=6,
                 va="top", ha="right")
    ax1.set_ylabel("validation loss")
    ax1.legend(loc="upper right")
    ax2.set_ylabel("RSS of the peer process, MB")
    ax2.set_xlabel("minutes")
    ax2.legend(loc="lower right", fontsize=7, ncol=4)
    fig.suptitle(f"soak: {len(res['faults'])} faults in {res['duration_s'] / 60:.1f} min")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


@click.command()
@click.option("--peers", default=6, show_default=True, help="peers at the start")
@click.option("--minutes", default=30.0, show_default=True, help="how long the faults run")
@click.option("--seed", default=0, show_default=True, help="seed of the fault schedule")
@click.option("--fault-every-s", default=30.0, show_default=True, help="mean seconds between faults")
@click.option("--stop-s", default=20.0, show_default=True, help="how long a SIGSTOP lasts")
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), help="[runs/soak-<date>-<time>]")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), help="write the figures here")
@click.option("--png", "png_out", type=click.Path(dir_okay=False, path_type=Path), help="[<run-dir>/soak.png]")
def main(peers, minutes, seed, fault_every_s, stop_s, run_dir, json_out, png_out) -> None:
    if peers < 3:
        raise click.BadParameter("at least 3 (p0 and p1 are never faulted)", param_hint="--peers")
    run_dir = (run_dir or Path("runs") / time.strftime("soak-%Y%m%d-%H%M%S")).resolve()
    if run_dir.exists() and any(run_dir.iterdir()):
        raise click.BadParameter(f"{run_dir} is not empty", param_hint="--run-dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    soak = Soak(run_dir, peers, seed, stop_s)
    signal.signal(signal.SIGINT, lambda *_: soak.stop.set())
    signal.signal(signal.SIGTERM, lambda *_: soak.stop.set())
    sampler = threading.Thread(target=soak.sample, daemon=True)
    t0 = time.time()
    try:
        soak.start_bootstrap()
        names = [soak.start_peer(f"p{i}", "initial", wait=False) for i in range(peers)]
        for n in names:
            soak.sup.wait_ready(soak.sup.children[n], 240)
        t0 = time.time()
        sampler.start()
        print(f"{peers} peers ready; faults every ~{fault_every_s:.0f} s for {minutes} min; run dir {run_dir}",
              flush=True)
        end = t0 + minutes * 60
        while not soak.stop.is_set():
            wait = fault_every_s * soak.rng.uniform(0.8, 1.2)
            if time.time() + wait >= end or soak.stop.wait(wait):
                break
            kind = soak.next_kind()
            rec = soak.fault(kind)
            soak.faults.append(rec)
            print(f"t={(rec['time'] - t0) / 60:5.1f} min fault={kind} peer={rec['peer']}", flush=True)
        soak.stop.wait(max(0.0, end - time.time()))
    finally:
        soak.stop.set()
        t1 = time.time()
        # peers first (a peer still starting needs the bootstrap to start, and then to stop cleanly), then the rest
        peers_now = [n for n in soak.sup.children if n != "bootstrap"]
        codes = soak.sup.stop_all(30, names=peers_now)
        codes |= soak.sup.stop_all(30, names=["bootstrap"]) if "bootstrap" in soak.sup.children else {}
        # sockets of processes that were kill -9'd (or died of a signal) are expected leftovers (docs/hivemind.md
        # §5); those of processes that exited 0 are a leak of their shutdown path
        unclean = {n for n, i in soak.incs.items() if i.hard_killed} | {n for n, c in codes.items() if c != 0}
        left = soak.sup.settle()
        of_unclean = [s for n in unclean if n in soak.sup.children for s in soak.sup.leftovers(n).sockets]
        soak.sup.cleanup()
    leftovers = {"processes": left.processes, "sockets": [s for s in left.sockets if s not in of_unclean],
                 "sockets_of_kill9": of_unclean, "shm": left.shm}
    incs = soak.collect()
    res = analyse(incs, t0=t0, t1=t1, exchange_timeout_s=EXCHANGE_TIMEOUT_S, grace_s=GRACE_S, leftovers=leftovers,
                  faults=[{**f, "minute": (f["time"] - t0) / 60} for f in soak.faults], stop_s=stop_s)
    hard = {n for n, i in soak.incs.items() if i.hard_killed}  # their -9 is the fault itself
    res.update(seed=seed, peers=peers, exit_codes=codes,
               bad_exits={n: c for n, c in codes.items() if c != 0 and n not in hard})
    print(format_table(res))
    png = png_out or run_dir / "soak.png"
    plot(incs, res, t0, png)
    print(f"plot: {png}")
    if json_out:
        json_out.write_text(json.dumps(res, indent=1))
        print(f"figures: {json_out}")


if __name__ == "__main__":
    main()
