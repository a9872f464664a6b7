"""Heterogeneous-bandwidth benchmark (issue #5 item 4): GASLoC against DiLoCo on a swarm of real `gasloc peer`
processes, half of them on 10x slower links; time for the swarm's mean validation loss to reach a target that
every run reaches.

Setup (bench/netlab.py): one network namespace per process on a star (hub bridge), tbf on both veth ends. One
`gasloc bootstrap` on a fast link, N peers (default 6): even-numbered ones on fast links (default 30 Mbit up and
down), odd-numbered ones on slow links (default 3 Mbit). Tiny model (0.9M parameters = 3.5 MB of fp32 per message),
small batches and H = 20 inner steps per round, so that one round's compute (about two seconds) is small next to a
transfer over a slow link (3.5 MB at 3 Mbit = 9.3 s): communication matters.

Runs, one after another, each with a fresh bootstrap and fresh peers for the same wall-clock duration:
  gasloc-bw   outer.algorithm=gasloc, bandwidth-aware: swarm.bandwidth_weighting=true (partners drawn by measured
              bandwidth) and swarm.slower_link_ratio=3 (for the first half of each partner search, a peer passes
              over, and answers busy to, peers whose last exchange with it ran over 3x slower than its best;
              until it has seen such a peer, it tries peers it never exchanged with first)
  gasloc      outer.algorithm=gasloc, uniform partner choice
  diloco      outer.algorithm=diloco: one model, stepped by the exact mean over a group of its epoch (hivemind
              DecentralizedAverager, groups keyed by epoch, no solo step, a start barrier of all N peers, the fork
              check: peer/swarm/diloco.py). Before 2026-12-05 this run was a DiLoCo that forked into lineages
              (solo rounds, partial groups; docs/hetero-results.md keeps those figures as history)
  gossip      (optional) outer.algorithm=gossip
  gasloc-overlap  (optional) gasloc with outer.overlap=true: each exchange runs during the next round's inner steps
  gasloc-bw-open10  (optional) gasloc-bw with swarm.slower_link_open_share=0.1 instead of its default 0.25
  gasloc-bw-fp32, gasloc-bw-int8  (optional) gasloc-bw with exchange.codec float32 (4 bytes a parameter) or int8,
              against the default codec's gasloc-bw (issue 32: the time to target the byte savings buy)
  gasloc-bw-m09, gasloc-m09  (optional) gasloc-bw and gasloc with outer.momentum=0.9, GASLoC's default until
              2026-11-30 (DiLoCo's); gasloc-bw-m09-open10 adds the open share 0.1, gasloc-bw-m09-k0
              outer.mix_momentum=0 (outer momentum carries only each peer's own progress; a mix moves the model
              once, to the pair's mean)
  gasloc-bw-k1  (optional) gasloc-bw with outer.mix_momentum=1: the default codec's mixes carried whole by the
              outer momentum, as before the codec brought its own 0.5 (docs/codecs.md, invocation J)

Schedule, as a user runs either method: the same tokens per peer per round (H inner steps of the same batch) and
the inner lr decayed by a cosine to 0.1 of its peak over the run. A run's length is wall-clock here, so each
algorithm's decay spans the rounds its typical peer does in --duration-s: --decay-rounds (per 180 s, per algorithm
or per run name, a run's own entry first; defaults: DECAY_ROUNDS below), scaled with the duration. A run on another
wire does another number of rounds in the same time (fp32 sends 8x the bytes of the default codec), so it gets its
own entry, measured in a run of its own (L0 in docs/codecs.md). The
lr follows the swarm's position (round x H; a joiner takes over the round), and stays at 0.1 past the end.

The swarm's mean validation loss at time t is the mean over peers of each peer's latest val_loss at or before t
(the start event's initial_loss counts as its first). The clock of a run starts when every peer has printed READY.
Target = the highest final mean loss over the runs + --target-margin, so every run reaches it.

--repeats N makes every run N times, the order of the runs reversed every other time (ABC, CBA, ABC, ...): two runs
of one swarm made one after another differed by up to 3 % in loss, the later one lower in four invocations and
higher in the next (docs/codecs.md, L4-L8), so a single pair of close runs can read either way. Each repetition
is compared with DiLoCo's run of the same repetition, and the verdict reads each run's median time to target
against DiLoCo's median.

    sudo python bench/hetero.py --json hetero.json           # 3 runs x 180 s, about 12 min
    sudo python bench/hetero.py --quick                      # 3 runs x 45 s, a smoke run
    sudo python bench/hetero.py --runs gasloc-bw,gasloc-bw-k1 --repeats 4   # 8 runs, medians of 4 each
    sudo python bench/hetero.py --cleanup                    # remove leftovers of a crashed earlier run

Everything it creates (namespaces, links, processes, their sockets) is removed afterwards, also on Ctrl+C,
SIGTERM or an exception. Names start with `ghx<pid>x`; --cleanup removes those whose creator PID is gone.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parent))
import netlab  # noqa: E402  (bench/ is a directory of scripts, not a package)
from hetero_report import RunResult, analyse_run, format_report, pick_target  # noqa: E402

TAG = "ghx"
SLOWER_LINK_RATIO = 3.0  # bandwidth-aware runs: the links here differ 10x, and rates vary ~1.5x with the load
RUNS = {  # name -> (outer.algorithm, bandwidth-aware (None: not applicable), further settings: dotted key -> value)
    "gasloc-bw": ("gasloc", True, {}),
    "gasloc": ("gasloc", False, {}),
    "diloco": ("diloco", None, {}),
    "gossip": ("gossip", False, {}),
    "gasloc-overlap": ("gasloc", False, {"outer.overlap": "true"}),
    "gasloc-bw-open10": ("gasloc", True, {"swarm.slower_link_open_share": "0.1"}),
    # GASLoC's outer momentum before it became 0.7 (docs/hetero-results.md compares them)
    "gasloc-bw-m09": ("gasloc", True, {"outer.momentum": "0.9"}),
    "gasloc-m09": ("gasloc", False, {"outer.momentum": "0.9"}),
    "gasloc-bw-m09-open10": ("gasloc", True, {"outer.momentum": "0.9", "swarm.slower_link_open_share": "0.1"}),
    "gasloc-bw-m09-k0": ("gasloc", True, {"outer.momentum": "0.9", "outer.mix_momentum": "0"}),
    # gasloc-bw on another wire than the default codec (mod4-sd, 4 bits a parameter): the lossless one, and int8
    "gasloc-bw-fp32": ("gasloc", True, {"exchange.codec": "float32"}),
    "gasloc-bw-int8": ("gasloc", True, {"exchange.codec": "int8"}),
    "gasloc-bw-k1": ("gasloc", True, {"outer.mix_momentum": "1"}),
}
DEFAULT_RUNS = ("gasloc-bw", "gasloc", "diloco")
# Rounds per 180 s over which each algorithm's inner lr decays (module docstring): its peers' rounds with today's
# default codecs, so each run ends its cosine where it ends (invocation J1 of docs/hetero-results.md, 2026-12-05:
# GASLoC int8 45 rounds a fast peer, DiLoCo float16 11-12 all-reduces of all six). Before J1: 48 and 18 (H1's, with
# int4 and uint8), under which J1's DiLoCo ended a third of the way short of its floor; H1 itself decayed over 15
# and 6 (estimates from fp32 runs): both sat at the floor for most of the run. With mod4-sd, the default codec since,
# gasloc-bw made 44.7-49.0 rounds a fast peer (L1-L3 of docs/codecs.md), so gasloc's 45 stays
DECAY_ROUNDS = "diloco=12,gasloc=45,gossip=45"

# Hyperparameters shared by every run (the [outer] defaults of each algorithm apply). Timeouts are raised so that
# a slow link finishes its transfer: 3.5 MB at 3 Mbit takes 9.3 s for a pair, and an all-reduce part shares the
# slow uplink with four others (hivemind's default 3 s chunk timeout would drop slow peers from every group).
PEER_TOML = """\
[model]
preset = "tiny"
seq_len = 64

[data]
batch_size = 4
val_batches = 4

[inner]
inner_steps = {inner_steps}
warmup_steps = 20
lr = 0.002
decay_type = "cosine"
min_lr_factor = 0.1

[exchange]
exchange_timeout_s = 60.0

[swarm]
partner_deadline_s = 10.0
announce_ttl_s = 15.0

[diloco]
initial_group_size = {peers}
matchmaking_time_s = 5.0
request_timeout_s = 3.0
averaging_timeout_s = 120.0
next_chunk_timeout_s = 30.0

[run]
eval_every_rounds = 1
torch_threads = 1
device = "cpu"
"""


class BenchError(RuntimeError):
    """The benchmark could not run; one line for the user."""


class Interrupted(BaseException):
    """SIGINT/SIGTERM: unwinds through every finally (BaseException, so no `except Exception` swallows it)."""


def _on_signal(signum, frame):
    raise Interrupted(signal.Signals(signum).name)


@dataclass(frozen=True)
class Settings:
    peers: int
    duration_s: float
    fast_mbit: float
    slow_mbit: float
    inner_steps: int
    decay_rounds: tuple[tuple[str, float], ...] = ()  # (algorithm or run, rounds per 180 s); empty: no lr decay
    boot_mbit: float = 100.0
    ready_timeout_s: float = 240.0
    stop_grace_s: float = 30.0

    def total_steps(self, algorithm: str, run: str = "") -> int | None:
        """inner.total_steps of a run: its decay rounds (the run's own entry, else its algorithm's), scaled to the
        run's duration, times H."""
        rounds = dict(self.decay_rounds)
        per_180 = rounds.get(run, rounds.get(algorithm))
        if per_180 is None:
            return None
        return self.inner_steps * max(2, round(per_180 * self.duration_s / 180))

    def peer_node(self, i: int) -> netlab.Node:
        return netlab.Node(f"p{i}", self.fast_mbit if i % 2 == 0 else self.slow_mbit)


def _child_env(shard: tuple[int, int] | None = None, bandwidth_aware: bool | None = None,
               settings: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GASLOC_")}
    # one thread per process: 7 processes (plus their DHT children) share the machine's cores
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", GASLOC_LOG_LEVEL="INFO")
    if shard is not None:  # each peer trains on its own shard of the corpus
        env["GASLOC_DATA__SHARD_INDEX"], env["GASLOC_DATA__NUM_SHARDS"] = map(str, shard)
    if bandwidth_aware is not None:
        env["GASLOC_SWARM__BANDWIDTH_WEIGHTING"] = "true" if bandwidth_aware else "false"
        env["GASLOC_SWARM__SLOWER_LINK_RATIO"] = str(SLOWER_LINK_RATIO if bandwidth_aware else 0.0)
    for key, value in (settings or {}).items():  # the peer's env override of a config key: GASLOC_SECTION__KEY
        env["GASLOC_" + key.replace(".", "__").upper()] = value
    return env


def run_order(names: list[str], repeats: int) -> list[tuple[str, int]]:
    """(run, repetition) in the order they run: the runs as given, then reversed, and so on, so each run takes each
    place in turn (the module docstring says why). Repetition 0: the runs are made once."""
    if repeats == 1:
        return [(n, 0) for n in names]
    return [(n, k + 1) for k in range(repeats) for n in (names if k % 2 == 0 else names[::-1])]


def run_label(name: str, repeat: int) -> str:
    return f"{name}#{repeat}" if repeat else name


def run_one(name: str, sup, star: netlab.Star, s: Settings, out: Path, peer_config: Path,
            repeat: int = 0) -> RunResult:
    """One swarm: bootstrap + peers for s.duration_s after all are READY; returns its metrics, analysed."""
    from gasloc.runtime.procs import gasloc_argv

    algorithm, bw, settings = RUNS[name]
    total = s.total_steps(algorithm, name)
    if total is not None and "inner.total_steps" not in settings:
        settings = {**settings, "inner.total_steps": str(total)}
    label = run_label(name, repeat)
    run_dir = out / (f"{name}-{repeat}" if repeat else name)
    run_id = f"hetero-{name}-{repeat}-{os.getpid()}"
    names = [f"{label}/boot"] + [f"{label}/p{i}" for i in range(s.peers)]
    try:
        boot = sup.start(names[0], star.exec_argv("boot", gasloc_argv(
            "bootstrap", "--run-id", run_id, "--host-maddrs", f"/ip4/{star.ip('boot')}/tcp/0",
            "--identity-path", str(run_dir / "boot.key"), "--log-interval-s", "10")),
            run_dir / "boot.log", env=_child_env())
        boot_maddr = sup.wait_ready(boot, s.ready_timeout_s)["maddrs"][0]
        peers = []
        for i in range(s.peers):
            node = f"p{i}"
            argv = gasloc_argv("peer", "--config", str(peer_config), "--run-id", run_id, "--algorithm", algorithm,
                               "--run-dir", str(run_dir / node), "--host-maddrs", f"/ip4/{star.ip(node)}/tcp/0",
                               "--initial-peers", boot_maddr, "--no-checkpoint")
            peers.append(sup.start(names[i + 1], star.exec_argv(node, argv), run_dir / f"{node}.log",
                                   env=_child_env((i, s.peers), bw, settings)))
        for p in peers:
            sup.wait_ready(p, s.ready_timeout_s)
        t0 = time.time()
        click.echo(f"[{label}] {s.peers} peers ready; running {s.duration_s:.0f} s")
        end = time.monotonic() + s.duration_s
        while time.monotonic() < end:
            for p in [boot, *peers]:
                if p.poll() is not None:
                    raise BenchError(f"[{label}] {p.name} exited with code {p.poll()} during the run; log "
                                     f"{p.log_path}:\n{p.log_tail()}")
            time.sleep(0.5)
        t_end = time.time()
    finally:
        sup.stop_all(s.stop_grace_s, names=[n for n in names if n in sup.children])
    fast = {f"p{i}" for i in range(s.peers) if i % 2 == 0}
    metrics = {f"p{i}": run_dir / f"p{i}" / "metrics.jsonl" for i in range(s.peers)}
    result = analyse_run(label, algorithm, bw, metrics, fast, t0, t_end)
    result.repeat, result.base = repeat, name
    return result


def parse_decay_rounds(text: str) -> tuple[tuple[str, float], ...]:
    if text.strip().lower() == "none":
        return ()
    out = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        algorithm, _, rounds = item.partition("=")
        try:
            value = float(rounds)
        except ValueError:
            value = -1.0
        if algorithm.strip() not in ("gasloc", "diloco", "gossip", *RUNS) or value <= 0:
            raise click.BadParameter(f"{item!r}: expected NAME=ROUNDS with NAME an algorithm (gasloc, diloco, "
                                     f"gossip) or a run (--runs) and ROUNDS > 0", param_hint="--decay-rounds")
        out.append((algorithm.strip(), value))
    return tuple(out)


def probe_links(star: netlab.Star, s: Settings) -> dict[str, float]:
    """Measured TCP Mbit/s of a fast->fast and a fast->slow transfer (is the shaping what we asked for?)."""
    out = {}
    for src, dst, nbytes in (("p0", "p2", 2_000_000), ("p0", "p1", 1_000_000)):
        if dst in star.nodes:
            out[f"{src}->{dst}"] = nbytes * 8 / 1e6 / netlab.measure_transfer(star, src, dst, nbytes, timeout_s=30)
    return out


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


@click.command()
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="write the rows (and details) here")
@click.option("--quick", is_flag=True, help="smoke run: 45 s per run")
@click.option("--cleanup", "cleanup_only", is_flag=True, help="remove namespaces (and processes in them) left by a "
              "crashed earlier run, then exit")
@click.option("--runs", default=",".join(DEFAULT_RUNS), show_default=True,
              help=f"comma-separated, from {', '.join(RUNS)}")
@click.option("--repeats", type=click.IntRange(1, 20), default=1, show_default=True,
              help="make every run this many times, the runs' order reversed every other time; the verdict then "
              "reads each run's median")
@click.option("--peers", type=click.IntRange(2, 16), default=6, show_default=True)
@click.option("--duration-s", type=click.FloatRange(10), help="seconds per run after all peers are ready "
              "[180; --quick 45]")
@click.option("--fast-mbit", type=click.FloatRange(0.1), default=30.0, show_default=True)
@click.option("--slow-mbit", type=click.FloatRange(0.1), default=3.0, show_default=True)
@click.option("--inner-steps", type=click.IntRange(1), default=20, show_default=True, help="H, every run")
@click.option("--decay-rounds", default=DECAY_ROUNDS, show_default=True,
              help="NAME=ROUNDS,...: each algorithm's (or run's: its own entry first) inner lr decays (cosine to "
              "0.1) over this many rounds per 180 s of --duration-s; 'none': no decay (the lr stays at its peak, "
              "as before 2026-12-05)")
@click.option("--target-margin", type=click.FloatRange(0), default=0.02, show_default=True,
              help="nats added to the highest final mean loss to make the target")
@click.option("--peer-config", type=click.Path(exists=True, dir_okay=False), help="TOML for every peer instead "
              "of the built-in one (the benchmark still sets algorithm, run id, addresses, shard, weighting)")
@click.option("--out-dir", type=click.Path(file_okay=False), help="logs and metrics [runs/hetero-<time>]")
def main(json_out, quick, cleanup_only, runs, repeats, peers, duration_s, fast_mbit, slow_mbit, inner_steps,
         decay_rounds, target_margin, peer_config, out_dir) -> None:
    """GASLoC vs DiLoCo on real peers with half the links 10x slower: time to a common target loss."""
    names = [r.strip() for r in runs.split(",") if r.strip()]
    bad = [r for r in names if r not in RUNS]
    if bad or not names:
        raise click.BadParameter(f"unknown run(s) {bad}; choose from {', '.join(RUNS)}", param_hint="--runs")
    twice = sorted({r for r in names if names.count(r) > 1})
    if twice:   # the two would share a run directory and a label; --repeats makes a run again, in both orders
        raise click.BadParameter(f"{', '.join(twice)} listed more than once; --repeats N makes every run N times",
                                 param_hint="--runs")
    why = netlab.unavailable_reason()
    if why is not None:
        raise click.ClickException(f"this benchmark {why}")
    if cleanup_only:
        removed = netlab.cleanup(TAG)
        click.echo(f"removed {len(removed)} namespaces" + (f": {' '.join(removed)}" if removed else ""))
        return
    s = Settings(peers, duration_s or (45.0 if quick else 180.0), fast_mbit, slow_mbit, inner_steps,
                 parse_decay_rounds(decay_rounds))
    out = Path(out_dir or f"runs/hetero-{datetime.now():%Y%m%d-%H%M%S}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    if peer_config is None:
        peer_config = out / "peer.toml"
        peer_config.write_text(PEER_TOML.format(inner_steps=inner_steps, peers=peers))
    stale = [ns for ns in netlab.list_namespaces() if ns.startswith(TAG)]
    if stale:
        click.echo(f"note: namespaces of other or crashed runs exist ({' '.join(stale)}); "
                   f"`bench/hetero.py --cleanup` removes those of dead runs", err=True)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _on_signal)
    star = netlab.Star(netlab.run_prefix(TAG), [netlab.Node("boot", s.boot_mbit)] +
                       [s.peer_node(i) for i in range(s.peers)])
    sup = None
    results, error, loads = [], None, {}
    load_before = loadavg()
    try:
        from gasloc.runtime.procs import Supervisor

        star.up()
        click.echo(f"star {star.prefix}: {star.describe()}")
        links = probe_links(star, s)
        click.echo("measured links: " + ", ".join(f"{k} {v:.1f} Mbit/s" for k, v in links.items()))
        sup = Supervisor()
        for name, repeat in run_order(names, repeats):
            label = run_label(name, repeat)
            loads[label] = [loadavg()]
            click.echo(f"[{label}] starting (load average {loads[label][0]})")
            results.append(run_one(name, sup, star, s, out, Path(peer_config).resolve(), repeat))
            loads[label].append(loadavg())
    except Interrupted as e:
        error = f"interrupted by {e}"
    except (BenchError, netlab.NetlabError) as e:
        error = str(e)
    except Exception as e:  # noqa: BLE001 - any failure still reaches the cleanup below and one clear line
        error = f"{type(e).__name__}: {e}"
    finally:
        # nothing may stop the cleanup half-way: a second Ctrl+C now would leave namespaces and processes behind
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        if error:
            click.echo(f"{error}; cleaning up", err=True)
        left = None
        if sup is not None:
            sup.stop_all(s.stop_grace_s)
            left = sup.cleanup()
        removed = star.down()
        click.echo(f"cleanup: removed {len(removed)} namespaces; leftovers before the final sweep: "
                   f"{left if left else 'none'}")
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
    if error:
        click.echo(f"Error: {error}", err=True)
        sys.exit(1)

    target = pick_target(results, target_margin)
    settings = {**s.__dict__, "repeats": repeats, "target_margin": target_margin,
                "peer_config": Path(peer_config).read_text(), "load_before": load_before, "load_after": loadavg(),
                "load_per_run": loads, "links_measured_mbit": links, "out_dir": str(out)}
    report, doc = format_report(results, target, settings)
    click.echo(report)
    if json_out:
        Path(json_out).write_text(json.dumps(doc, indent=2) + "\n")
        click.echo(f"wrote {json_out}")


if __name__ == "__main__":
    main()
