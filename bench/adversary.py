"""Adversary bench (issue 29): hostile volunteers that know the guard, as real `gasloc peer` processes, against
clean swarms run in the same invocation.

Each swarm: one `gasloc bootstrap` (shared), 4 honest peers (the same data streams in every swarm: seed files h0-h3)
and the mode's hostile peers, for --rounds rounds each, the tiny model, validation every round. Modes:

  noisy        [fault] noise_std = 0.02: Gaussian noise on its parameters after every inner step
  scaled       [fault] send_scale = 3: offers 3y
  uphill       [fault] bias = "uphill": trains and mixes honestly, offers y + b, b along its own summed inner
               gradients (uphill for everyone), ||b|| = 0.75 x its own guard's tau x ||y|| (peer/fault.py)
  fixed        the same with b in one random direction, the same every round ("a little is enough")
  one-tensor   uphill with all of b in the token embedding (parameter 0): one norm over all tensors cannot tell
  echo         receives the partner's payload first and sends those bytes back (EchoExchanger): accepted at d ~ 0
  ready-liar   uphill, and its record says "exchanging" always and a round 1000 ahead
  long-lived   ready-liar whose record lives a day (announce_ttl_s 86400), killed -9 after 4 rounds: a ghost
  donor-round  started first, the only peer claiming a round > 0, so every honest joiner downloads from it: its
               state says round 10^9 (header and metadata), then "soon", then -7 (metadata only), one per snapshot
  donor-id     the same, its metadata names another live peer
  donor-zprev  the same, its outer state (z_prev) shifted by 0.3 x each tensor's norm in a random direction: an
               arbitrary jump at the adopter's next outer step
  donor-tuned  the same, its parameters a fresh model fitted to the first validation batch (which every peer shares)
  sybil        three uphill ready-liars at once (three identities, one operator: three processes here, since a
               `gasloc peer` holds one identity per p2pd)

Figures per swarm (honest peers only):
  val          median over honest peers of the last round's validation loss (every peer ran --rounds rounds)
  vs clean     val / the median of the clean swarms' vals (target: <= 1.05; sybil 1.10)
  crashes      honest peers that exited non-zero or reported fewer rounds
  adopted      joins or resyncs that took over a hostile peer's state (the joiner's log names the adopted donor by
               its transport id; a donor's claimed id is not used)
  share        the hostile peers' share of the partners whose tensors honest guards judged (accepted or not)
  verdicts     the honest guards' verdicts on hostile offers: accept / clip / reject
  wrong rej    rejections of an honest partner by an honest peer: all rounds / after round 6
  resyncs      resync events of honest peers (any reason)

With --repeats R each mode runs R swarms (one after another, every mode once before any mode twice) and a second
table gives per mode the median of its swarms' vals against the clean median: one swarm per mode cannot be judged
against a 5 % bound when clean swarms of 16 rounds differ by 10 % among themselves.

    python bench/adversary.py                              # every mode, 16 rounds, 3 clean swarms
    python bench/adversary.py --modes uphill,echo --rounds 12 --json adv.json
    python bench/adversary.py --repeats 3 --clean 5        # per mode the median of 3 swarms
"""
from __future__ import annotations

import json
import math
import os
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import click

HONEST = ["h0", "h1", "h2", "h3"]
LOOPBACK = "/ip4/127.0.0.1/tcp/0"
INFLATE = 1000          # rounds a lying record claims beyond its own
LATE_ROUND = 6          # honest peers must not reject each other after this round (issue 29)
MADE_UP_PEER_ID = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"

# The e2e swarms' settings (tests/e2e/swarm_helpers.py): short rounds of the tiny model, so one swarm of 16 rounds
# takes about two minutes on 2 shared cores.
PEER_TOML = """\
[model]
preset = "tiny"
seq_len = 64
[data]
batch_size = 4
val_batches = 2
[inner]
inner_steps = {inner_steps}
warmup_steps = 10
lr = 0.002
[exchange]
exchange_timeout_s = 2.5
accept_timeout_s = 1.0
[swarm]
run_id = "{run_id}"
announce_ttl_s = {ttl_s}
partner_deadline_s = 1.2
min_backoff_s = 3.0
max_backoff_s = 8.0
[run]
eval_every_rounds = 1
torch_threads = 1
device = "cpu"
"""

UPHILL = '[fault]\nbias = "uphill"\n'


@dataclass(frozen=True)
class Mode:
    fault: str = ""                  # the hostile peers' [fault] section
    lies: tuple[str, ...] = ()       # protocol-side lies of the hostile process (HostilePeer)
    count: int = 1                   # hostile peers
    first: bool = False              # started (and READY) before the honest peers: they join from it
    ttl_s: float | None = None       # the hostile's announce_ttl_s
    kill_after: int | None = None    # kill -9 the hostile's group after this many of its rounds
    bound: float = 1.05


MODES: dict[str, Mode] = {
    "noisy": Mode(fault="[fault]\nnoise_std = 0.02\n"),   # the attackers the guard was first built against
    "scaled": Mode(fault="[fault]\nsend_scale = 3.0\n"),
    "uphill": Mode(fault=UPHILL),
    "fixed": Mode(fault='[fault]\nbias = "fixed"\n'),
    "one-tensor": Mode(fault=UPHILL + "bias_tensor = 0\n"),
    "echo": Mode(lies=("echo",)),
    "ready-liar": Mode(fault=UPHILL, lies=("ready",)),
    "long-lived": Mode(fault=UPHILL, lies=("ready",), ttl_s=86400.0, kill_after=4),
    "donor-round": Mode(lies=("donor-round",), first=True),
    "donor-id": Mode(lies=("donor-id",), first=True),
    "donor-zprev": Mode(lies=("donor-zprev",), first=True),
    "donor-tuned": Mode(lies=("donor-tuned",), first=True),
    "sybil": Mode(fault=UPHILL, lies=("ready",), count=3, bound=1.10),
}
LIES = ("ready", "echo", "donor-round", "donor-id", "donor-zprev", "donor-tuned")


def child_env() -> dict[str, str]:
    """The bench's environment minus GASLOC_* settings, one torch thread per child, INFO logs (the adoption count
    reads the joiners' logs)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GASLOC_")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", GASLOC_LOG_LEVEL="INFO")
    return env


# ---------------------------------------------------------------------------------------------- the hostile process

def hostile_peer_class(lies: tuple[str, ...]):
    """A Peer subclass that lies as `lies` say (built lazily: importing the daemon pulls in torch and hivemind)."""
    import torch

    from gasloc.peer.daemon import Peer
    from gasloc.peer.swarm.network import PeerStatus

    class _Claims(dict):
        """Snapshot metadata whose "round" the donor's own state server reads as 0 (its reply header demands an int
        >= 0) while the dict sent in the reply's metadata carries the lie: what a modified donor sends."""

        def get(self, key, default=None):
            return 0 if key == "round" else super().get(key, default)

    class HostilePeer(Peer):
        served = 0
        _tuned: list | None = None

        def _status(self) -> PeerStatus:
            s = super()._status()
            if s.state == "joining":
                return s
            if "ready" in lies:     # always ready, far ahead: first in every search and donor pool
                return PeerStatus("exchanging", s.round + INFLATE, s.throughput_tps, s.bandwidth_bps, s.view)
            if any(lie.startswith("donor-") for lie in lies):   # a donor candidate from the start (round > 0)
                return PeerStatus(s.state, s.round + INFLATE, s.throughput_tps, s.bandwidth_bps, s.view)
            return s

        def _main_loop(self) -> None:
            # a lying donor serves the state it started with: its joiners get no head start from it, so what the
            # honest swarm's loss shows is the lie, not a donor that trained alone before they came
            self._start_state = [p.detach().to("cpu", copy=True) for p in self.params]
            super()._main_loop()

        def snapshot(self):
            meta, tensors = super().snapshot()
            n_params = len(self.params)
            params, outer = tensors[:n_params], tensors[n_params:]
            if any(lie.startswith("donor-") for lie in lies):
                params = [t.clone() for t in self._start_state]
                outer = [t.clone() for t in self._start_state][:len(outer)]   # form C: z_prev = the point itself
            lie = None
            if "donor-round" in lies:
                # 10^9 in the reply header and the metadata alike (consistent: no format check can tell), then the
                # two a header cannot carry (its round is an int >= 0), in the metadata only
                lie = [10 ** 9, "soon", -7][self.served % 3]
                meta = dict(meta, round=lie) if isinstance(lie, int) and lie >= 0 else _Claims(meta, round=lie)
            if "donor-id" in lies:
                others = sorted(set(self.net.live) - {self.peer_id}) if self.net is not None else []
                meta["peer_id"] = random.choice(others) if others else MADE_UP_PEER_ID
                lie = f"peer_id={meta['peer_id']}"
            if "donor-zprev" in lies:
                gen = torch.Generator().manual_seed(self.served)
                outer = [t + 0.3 * t.norm() * (u := torch.randn(t.shape, generator=gen)) / u.norm() for t in outer]
                lie = "z_prev shifted by 0.3 x each tensor's norm"
            if "donor-tuned" in lies:
                params = self._tuned_state()
                outer = [t.clone() for t in params][:len(outer)]
                lie = "parameters fitted to the shared validation batch"
            self.served += 1
            self.sink.emit("hostile_snapshot", round=self.round, lie=str(lie))
            return meta, params + outer

        def _tuned_state(self) -> list:
            """A fresh model (another seed) fitted to val_batches[0] alone: low loss there, none learned elsewhere."""
            if self._tuned is None:
                from gasloc.peer.train.model import build_model
                vocab = self.params[0].shape[0]   # parameter 0 is the token embedding
                model = build_model(self.cfg.model, vocab, seed=12345)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
                batch = self.val_batches[0]
                for _ in range(60):
                    loss = model.loss(batch)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                self._tuned = [p.detach().to("cpu", copy=True) for p in model.parameters()]
                self.sink.emit("hostile_tuned", loss_on_shared_batch=float(loss.detach()))
            return [t.clone() for t in self._tuned]

    return HostilePeer


def echo_exchanger_class():
    """An Exchanger that reads the partner's whole payload before sending anything, then sends those very bytes
    back: the partner measures distance ~0 to itself and records it (issue 29 item 2)."""
    from gasloc.peer.transport import exchange as ex

    class EchoExchanger(ex.Exchanger):
        async def _duplex(self, channels, offer, codec, seed, eng, steps, send):
            return await echo_duplex(self, channels, offer, codec, seed, eng, steps)

    return EchoExchanger


async def echo_duplex(self, channels, offer, codec, seed, eng, steps=None):
    """Exchanger._duplex with the order changed: receive all of theirs (in `codec`), then send those bytes back as
    ours (with the swarm's one codec, also ours). What we mix ourselves is theirs, decoded."""
    from gasloc.peer.transport.lanes import move
    from gasloc.peer.transport.tensor_io import in_thread
    from gasloc.protocol.codes import Code

    bufs, out = self.staging.receive_buffers(codec)
    nothing = [b.new_empty(0) for b in bufs]
    await move(channels, nothing, bufs, self.cfg.chunk_bytes)            # receive only
    await move(channels, bufs, [b.new_empty(0) for b in bufs], self.cfg.chunk_bytes)   # their bytes, back
    # a modulo codec: what we sent is theirs, so we decode it against itself (our own tensors come back)
    bad = await in_thread(self.staging.decode, codec, bufs, out, seed, offer.tensors, bufs if codec.modulo else None,
                          steps)
    eng.verdict_sent = True
    await channels[0].write(bytes([Code.NOT_FINITE if bad else Code.OK]))
    theirs = Code.parse((await channels[0].readexactly(1))[0])
    if bad or theirs != Code.OK:
        self.staging.recycle(out)
        return None, None, theirs if not bad else Code.NOT_FINITE, "echo refused"
    return out, None, Code.OK, ""


# ---------------------------------------------------------------------------------------------- running swarms

@dataclass
class Swarm:
    tag: str
    mode: str | None
    honest: dict[str, str] = field(default_factory=dict)    # name -> peer id
    hostile: dict[str, str] = field(default_factory=dict)
    codes: dict[str, int | None] = field(default_factory=dict)


def write_config(path: Path, run_id: str, *, ttl_s: float = 6.0, inner_steps: int = 10, extra: str = "") -> Path:
    path.write_text(PEER_TOML.format(run_id=run_id, ttl_s=ttl_s, inner_steps=inner_steps) + extra)
    return path


def start_hostile(sup, run_dir: Path, name: str, config: Path, boot: str, rounds: int, lies: tuple[str, ...]):
    argv = [sys.executable, str(Path(__file__).resolve()), "hostile-peer", *(f"--lie={x}" for x in lies), "--",
            "--config", str(config), "--initial-peers", boot, "--host-maddrs", LOOPBACK, "--run-dir",
            str(run_dir / name), "--max-rounds", str(rounds), "--no-checkpoint"]
    return sup.start(name, argv, run_dir / f"{name}.log", env=child_env(), cwd=run_dir)


def run_swarm(sup, run_dir: Path, boot: str, tag: str, mode_name: str | None, rounds: int,
              timeout_s: float = 900.0) -> Swarm:
    """One swarm of HONEST (+ the mode's hostile peers) until every honest peer has run `rounds` rounds; the hostile
    peers are then stopped. Raises ChildFailed only when a peer never got READY."""
    from gasloc.runtime.procs import ChildFailed, gasloc_argv

    mode = MODES[mode_name] if mode_name else None
    run_id = f"adv-{tag}"
    cfg = write_config(run_dir / f"{tag}.toml", run_id)
    sw = Swarm(tag, mode_name)
    hostile_names = [f"{tag}-bad{i}" for i in range(mode.count)] if mode else []
    for n in HONEST:   # the same data streams in every swarm: what differs is the attacker and partner choice
        d = run_dir / f"{tag}-{n}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "worker_seed").write_text(f"{n}\n")
    hostile_children = {}
    if mode:
        bad_cfg = write_config(run_dir / f"{tag}-bad.toml", run_id, ttl_s=mode.ttl_s or 6.0, extra=mode.fault)
        for i, n in enumerate(hostile_names):
            (run_dir / n).mkdir(parents=True, exist_ok=True)
            (run_dir / n / "worker_seed").write_text(f"bad{i}\n")
            hostile_children[n] = start_hostile(sup, run_dir, n, bad_cfg, boot, rounds + 40, mode.lies)
        if mode.first:   # READY comes after its first announcement: the joiners see it in their first listing
            for n, c in hostile_children.items():
                sw.hostile[n] = sup.wait_ready(c, 150)["peer_id"]
    honest_children = {}
    for n in HONEST:
        name = f"{tag}-{n}"
        honest_children[name] = sup.start(name, gasloc_argv(
            "peer", "--config", str(cfg), "--initial-peers", boot, "--host-maddrs", LOOPBACK, "--run-dir",
            str(run_dir / name), "--max-rounds", str(rounds), "--no-checkpoint"), run_dir / f"{name}.log",
            env=child_env(), cwd=run_dir)
    for n, c in {**hostile_children, **honest_children}.items():
        if n in hostile_children and n in sw.hostile:
            continue
        try:
            ready = sup.wait_ready(c, 150)
        except ChildFailed:
            if n in honest_children:   # an honest peer that died at start (e.g. on a hostile donor's state)
                sw.honest[n] = ""
                continue
            raise
        (sw.hostile if n in hostile_children else sw.honest)[n] = ready["peer_id"]
    deadline = time.monotonic() + timeout_s
    killed = False
    while time.monotonic() < deadline:
        if mode and mode.kill_after and not killed:
            for n in hostile_names:
                if len(_events(run_dir / n, "round")) >= mode.kill_after:
                    sup.children[n].signal(9, group=True)
                    killed = True
        if all(c.poll() is not None for c in honest_children.values()):
            break
        time.sleep(0.5)
    for n, c in honest_children.items():
        if c.poll() is None:
            sup.stop(n, 15)
            sw.codes[n] = None   # ran past the timeout: counted as a crash
        else:
            sw.codes[n] = c.poll()
    for n in hostile_names:
        if sup.children[n].poll() is None:
            sup.stop(n, 15)
    sw.honest = {n: pid or _peer_id_from_log(run_dir / f"{n}.log") for n, pid in sw.honest.items()}
    return sw


def _peer_id_from_log(log: Path) -> str:
    m = re.search(r"peer_id=(\S+)", log.read_text(errors="replace")) if log.exists() else None
    return m.group(1) if m else ""


def _events(d: Path, event: str) -> list[dict]:
    path = d / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:   # a line being written
            continue
        if rec.get("event") == event:
            out.append(rec)
    return out


_ADOPTED = re.compile(r"join: adopted the state of (\S+) round=(-?\d+)")


def adoptions(log: Path) -> list[tuple[str, int]]:
    """(transport id of the donor, the round taken over) of each state this peer took over (joins and resyncs),
    from its log's one line per takeover (peer/daemon.py); a donor's claimed peer id is never used."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return [(donor, int(r)) for donor, r in _ADOPTED.findall(text)]


def measure(run_dir: Path, sw: Swarm, rounds: int) -> dict:
    """The row of one swarm (honest peers only; see the module docstring)."""
    hostile_ids = set(sw.hostile.values())
    honest_ids = {pid for pid in sw.honest.values() if pid}
    finals, crashes, ok, with_bad, wrong, verdicts = [], 0, 0, 0, 0, {"accept": 0, "clip": 0, "reject": 0}
    judged = 0
    adopted, resyncs, searched_on, wrong_late, adopted_rounds = 0, 0, 0, 0, []
    for n in sw.honest:
        rs = _events(run_dir / n, "round")
        if sw.codes.get(n) != 0 or len(rs) < rounds:
            crashes += 1
        vals = [r["val_loss"] for r in rs if r.get("val_loss") is not None]
        if vals and len(rs) >= rounds:
            finals.append(vals[-1])
        for r in rs:
            # every partner whose tensors an honest guard judged: the round's partner, and one rejected before it
            for p in ([r["partner"]] if r.get("guard") and r.get("partner") else []) + \
                    ([r["rejected_partner"]] if r.get("rejected_partner") else []):
                judged += 1
                with_bad += p in hostile_ids
            if r.get("outcome") == "ok" and r.get("partner") and r.get("group_size", 2) <= 2:
                ok += 1
            if r.get("guard") and r.get("partner") in hostile_ids:
                verdicts[r["guard"] if r["guard"] in verdicts else "clip"] += 1
            if r.get("rejected_partner") in hostile_ids and not (r.get("partner") in hostile_ids and r.get("guard")):
                verdicts["reject"] += 1
            if r.get("rejected_partner") in hostile_ids:
                searched_on += 1
            for p in {r.get("rejected_partner"), r.get("partner") if r.get("rejected") else None} - {None}:
                wrong += p in honest_ids
                wrong_late += p in honest_ids and r["round"] > LATE_ROUND
        took = [r for d, r in adoptions(run_dir / f"{n}.log") if d in hostile_ids]
        adopted += len(took)
        adopted_rounds += took
        resyncs += len(_events(run_dir / n, "resync"))
    return {"tag": sw.tag, "mode": sw.mode or "clean", "hostile": len(sw.hostile),
            "val": statistics.median(finals) if finals else math.nan, "finals": finals, "crashes": crashes,
            "adopted": adopted, "share": with_bad / judged if judged else 0.0, "ok_exchanges": ok, "verdicts": verdicts,
            "wrong_rejections": wrong, "wrong_rejections_late": wrong_late, "resyncs": resyncs,
            "searched_on": searched_on, "adopted_rounds": adopted_rounds,
            "hostile_served": sum(len(_events(run_dir / n, "hostile_snapshot")) for n in sw.hostile)}


def format_table(rows: list[dict], clean: float) -> str:
    head = (f"{'mode':<12} {'bad':>3} {'val':>6} {'vs clean':>8} {'target':>6} {'crash':>5} {'adopted':>7} "
            f"{'share':>6} {'acc/clip/rej':>12} {'wrong rej':>9} {'resyncs':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        ratio = r["val"] / clean if clean and math.isfinite(r["val"]) and math.isfinite(clean) else math.nan
        mode = MODES.get(r["mode"])
        if mode is None:
            target = "-"
        else:
            target = "met" if ratio <= mode.bound and not r["crashes"] and not r["adopted"] else "MISSED"
        v = r["verdicts"]
        change = f"{ratio - 1:+.1%}" if math.isfinite(ratio) else "-"
        lines.append(f"{r['mode']:<12} {r['hostile']:>3} {r['val']:>6.3f} {change:>8} {target:>6} "
                     f"{r['crashes']:>5} {r['adopted']:>7} {r['share']:>6.2f} "
                     f"{v['accept']:>4}/{v['clip']}/{v['reject']:<5} {str(r['wrong_rejections']) + '/' + str(r['wrong_rejections_late']):>9} {r['resyncs']:>7}")
    return "\n".join(lines)


def summarize(rows: list[dict], clean: float) -> list[dict]:
    """Per mode (clean included), over its swarms: the median val, its ratio to the clean median, the range, and
    whether the issue's target holds (median within the mode's bound, no honest crash and no hostile adoption in
    any of its swarms)."""
    out = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = [r for r in rows if r["mode"] == mode]
        vals = [r["val"] for r in mine if math.isfinite(r["val"])]
        med = statistics.median(vals) if vals else math.nan
        ratio = med / clean if vals and math.isfinite(clean) and clean else math.nan
        crashes, adopted = sum(r["crashes"] for r in mine), sum(r["adopted"] for r in mine)
        spec = MODES.get(mode)
        met = None if spec is None else bool(ratio <= spec.bound and not crashes and not adopted)
        out.append({"mode": mode, "swarms": len(mine), "median": med, "ratio": ratio,
                    "low": min(vals) if vals else math.nan, "high": max(vals) if vals else math.nan,
                    "crashes": crashes, "adopted": adopted, "bound": spec.bound if spec else None, "met": met})
    return out


def format_summary(summary: list[dict]) -> str:
    head = f"{'mode':<12} {'swarms':>6} {'median':>6} {'vs clean':>8} {'range':>13} {'bound':>6} {'target':>6}"
    lines = [head, "-" * len(head)]
    for m in summary:
        change = f"{m['ratio'] - 1:+.1%}" if math.isfinite(m["ratio"]) else "-"
        bound = f"{m['bound'] - 1:+.0%}" if m["bound"] else "-"
        target = "-" if m["met"] is None else "met" if m["met"] else "MISSED"
        lines.append(f"{m['mode']:<12} {m['swarms']:>6} {m['median']:>6.3f} {change:>8} "
                     f"{m['low']:>6.3f}-{m['high']:<6.3f} {bound:>6} {target:>6}")
    return "\n".join(lines)


@click.group(invoke_without_command=True)
@click.option("--modes", default=",".join(MODES), help=f"comma-separated: {', '.join(MODES)}")
@click.option("--rounds", default=16, type=click.IntRange(4), help="rounds per honest peer")
@click.option("--clean", "clean_runs", default=3, type=click.IntRange(1), help="clean swarms (their median is "
              "the baseline)")
@click.option("--repeats", default=1, type=click.IntRange(1), help="swarms per mode (the summary compares their "
              "median with the clean median)")
@click.option("--run-dir", type=click.Path(path_type=Path), default=None, help="default: runs/adv-<time>")
@click.option("--json", "json_out", type=click.Path(path_type=Path), default=None)
@click.pass_context
def main(ctx, modes, rounds, clean_runs, repeats, run_dir, json_out):
    if ctx.invoked_subcommand is not None:
        return
    from gasloc.runtime.procs import ChildFailed, Supervisor, gasloc_argv

    mode_list = [m for m in modes.split(",") if m]
    unknown = [m for m in mode_list if m not in MODES]
    if unknown or not mode_list:
        raise click.UsageError(f"--modes takes {', '.join(MODES)} (got {', '.join(unknown) or 'none'})")
    run_dir = (run_dir or Path("runs") / time.strftime("adv-%Y%m%d-%H%M%S")).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    json_out = json_out or run_dir / "adversary.json"
    meta = {"rounds": rounds, "repeats": repeats, "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), **_code_state()}
    click.echo(f"commit {meta['commit']}, {len(meta['uncommitted'])} file(s) differ from it; {run_dir}", err=True)
    sup = Supervisor()
    rows: list[dict] = []
    code = 0

    def one(tag: str, mode: str | None) -> None:
        try:
            sw = run_swarm(sup, run_dir, boot_addr, tag, mode, rounds)
            rows.append(measure(run_dir, sw, rounds))
            r = rows[-1]
            click.echo(f"{tag}: val {r['val']:.4f} crashes {r['crashes']} adopted {r['adopted']} share "
                       f"{r['share']:.2f} verdicts {r['verdicts']}", err=True)
        except ChildFailed as e:   # a swarm that could not start: its row says so, the next swarm runs
            click.echo(f"{tag}: Error: {e}", err=True)
            rows.append({"tag": tag, "mode": mode or "clean", "error": str(e)[:500]})
        # after every swarm, so a run cut short keeps what it measured
        json_out.write_text(json.dumps({**meta, "rows": rows}, indent=1))

    try:
        boot = sup.start("boot", gasloc_argv("bootstrap", "--host-maddrs", LOOPBACK, "--identity-path",
                                             str(run_dir / "boot.key")), run_dir / "boot.log", env=child_env())
        boot_addr = sup.wait_ready(boot, 90)["maddrs"][0]
        # the clean swarms first, so a run cut short still has its baseline
        for i in range(clean_runs):
            one(f"clean{i}", None)
        for k in range(repeats):   # every mode once before any twice: a drifting machine load hits all alike
            for m in mode_list:
                one(m if k == 0 else f"{m}-{k + 1}", m)
    except ChildFailed as e:
        click.echo(f"Error: {e} (logs in {run_dir})", err=True)
        code = 1
    finally:
        sup.stop_all(10.0)
        sup.cleanup()
    meta["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    good = [r for r in rows if "error" not in r]
    cleans = [r["val"] for r in good if r["mode"] == "clean" and math.isfinite(r["val"])]
    clean = statistics.median(cleans) if cleans else math.nan
    click.echo(f"clean swarms: {[round(c, 4) for c in cleans]} median {clean:.4f}; rounds {rounds}; "
               f"{meta['started']} - {meta['finished']}; commit {meta['commit']}")
    click.echo(format_table(good, clean))
    summary = summarize(good, clean)
    if repeats > 1 or clean_runs > 1:
        click.echo(f"\nper mode, the median of its swarms against the clean median {clean:.4f}:")
        click.echo(format_summary(summary))
    for r in rows:
        if "error" in r:
            click.echo(f"{r['tag']}: no row ({r['error'][:200]})")
    json_out.write_text(json.dumps({**meta, "clean_median": clean, "summary": summary, "rows": rows}, indent=1))
    sys.exit(code)


def _code_state() -> dict:
    """The commit this run measured, and the files of the working tree that differ from it (a shared tree)."""
    import subprocess
    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                                timeout=10).stdout.strip()
        status = subprocess.run(["git", "status", "--short", "--untracked-files=no"], cwd=root, capture_output=True,
                                text=True, timeout=10).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return {"commit": "?", "uncommitted": []}
    return {"commit": commit, "uncommitted": [line[3:] for line in status if line.strip()]}


@main.command("hostile-peer", hidden=True, context_settings={"ignore_unknown_options": True})
@click.option("--lie", "lies", multiple=True, type=click.Choice(LIES))
@click.argument("peer_args", nargs=-1, type=click.UNPROCESSED)
def hostile_peer(lies, peer_args):
    """`gasloc peer PEER_ARGS` made hostile by LIES (its [fault] section comes from its config as usual)."""
    from gasloc.runtime.procs import die_with_supervisor

    die_with_supervisor()
    import gasloc.peer.daemon as daemon
    from gasloc.peer.cli import peer

    daemon.Peer = hostile_peer_class(tuple(lies))
    if "echo" in lies:
        import gasloc.peer.swarm.gossip as gossip
        gossip.Exchanger = echo_exchanger_class()
    peer.main(args=list(peer_args), prog_name="gasloc peer")


if __name__ == "__main__":
    main()
