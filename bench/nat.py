"""NAT benchmark (issue 12): how a model-sized exchange fares between peers behind NAT, by path, and what the bundled
p2pd's circuit relay really allows. On the NAT lab (bench/netlab.py NatLab), with real p2pd daemons and gasloc's
own exchange code (peer/transport/exchange.py), one worker process per host (bench/nat_worker.py):

    relay   public host: p2pd forced public, announcing relay.lab (autorelay uses only public-looking addresses),
            a libp2p circuit relay (p2pd's own) and a gasloc forwarder (peer/swarm/forward.py)
    pub     public host
    na, nb  one host behind each of two home routers (MASQUERADE, nothing forwarded in), p2pd forced private with
            auto-relay and the relay as their static relay (-relayDiscovery=false: a reservation at once, not after
            go-libp2p's 3-minute boot delay); nb holds a relay reservation and a gasloc attachment

Paths, each for the tiny and the medium preset's parameters (float32, both ways at once, caller na):
    direct      na -> pub: a NATed peer calls a public one (no middle)
    relayed     na -> nb over a libp2p circuit through the relay (the connection dialled at the circuit address)
    forwarded   na -> nb through the relay's gasloc forwarder (RoutedP2P)
    holepunch   DCUtR over the relayed connection: the row reports what p2pd did (it needs a public address)

    python bench/nat.py --json nat.json                 # the table (both presets) and the relay's limits
    python bench/nat.py --relay-limits --json lim.json  # only the relay measurements (add --time-limit: +2.5 min)
    python bench/nat.py --quick --json q.json           # tiny preset, one run each, one relay trial
    python bench/nat.py --rows-only --json rows.json    # only the table (no relay trials)

Root only (ip netns, iptables). Everything is created in namespaces `gnb<pid>x...` and removed afterwards, also on
an exception or Ctrl+C; leftovers of a killed run are removed at the next start.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parent))
import netlab  # noqa: E402 - bench/ is not a package

WORKER = Path(__file__).with_name("nat_worker.py")
TAG = "gnb"
RELAY_PORT = 4001
KIB = 1024
GO_RELAY_DEFAULT_BYTES = 128 * KIB      # go-libp2p's circuit v2 default: 128 KiB and 2 minutes per relayed conn
PRESETS = ("tiny", "medium")


class BenchError(RuntimeError):
    """The benchmark could not run: a worker did not start, died, or did not answer."""


class Worker:
    """One nat_worker.py inside a lab namespace, spoken to with JSON lines."""

    def __init__(self, lab, host: str, *args: str):
        self.host = host
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(lab.exec_argv(host, [sys.executable, str(WORKER), *args]),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env, start_new_session=True)
        self.peer_id, self.maddrs = "", []

    def wait_ready(self) -> Worker:
        ready = self._read(90)
        if "ready" not in ready:
            raise BenchError(f"worker on {self.host} did not start: {ready}")
        self.peer_id, self.maddrs = ready["ready"]["peer_id"], ready["ready"]["maddrs"]
        return self

    def _read(self, timeout_s: float) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.proc.kill()
            err = self.proc.stderr.read()[-2000:] if self.proc.poll() is not None else "(no answer)"
            raise BenchError(f"worker on {self.host} gave no answer within {timeout_s:.0f} s: {err}")
        return json.loads(line)

    def call(self, op: str, wait_s: float = 120, **kw) -> dict:
        """Run `op` on the worker and wait at most `wait_s` for its answer."""
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        got = self._read(wait_s)
        if "error" in got and len(got) == 1:
            raise BenchError(f"{self.host} {op}: {got['error']}")
        return got

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            f.close()


def param_specs(preset: str) -> list[list[int]]:
    """The shapes of the preset's parameters (byte vocabulary, as `gasloc presets` counts them)."""
    from gasloc.peer.train.model import ModelConfig, build_model
    from gasloc.peer.train.tokenizer import ByteTokenizer
    model = build_model(ModelConfig(preset=preset), ByteTokenizer.vocab_size, seed=0)
    return [list(p.shape) for p in model.parameters()]


def payload_bytes(specs: list[list[int]]) -> int:
    total = 0
    for s in specs:
        n = 1
        for d in s:
            n *= d
        total += 4 * n
    return total


class Lab:
    """The four workers on a NatLab; `relay_flags` are extra p2pd flags of the relay's daemon.

    The NATed daemons reserve on the relay host as a static relay (`-relayDiscovery=false`, which hivemind's
    P2P.create never passes): go-libp2p's autorelay then needs as many candidates as there are static relays, one,
    and reserves at once. With discovery on (hivemind's default, `relay_discovery=True`) it waits for 4 candidates
    or its 3-minute boot delay, and a lab has 2 (the relay host and `pub`): that was the ~3-minute wait."""

    def __init__(self, nat, relay_flags: dict[str, str] | None = None, relay_discovery: bool = False):
        self.nat, self.workers = nat, {}
        self.relay_ip = nat.ip("relay")
        flags = [f"--p2pd-flag={k}={v}" for k, v in (relay_flags or {}).items()]
        try:
            self.relay = self._start("relay", "--port", str(RELAY_PORT), "--reachability", "public", "--forwarder",
                                     "--announce", f"/dns4/relay.lab/tcp/{RELAY_PORT}", *flags).wait_ready()
            self.relay_maddr = f"/ip4/{self.relay_ip}/tcp/{RELAY_PORT}/p2p/{self.relay.peer_id}"
            relay_dns = f"/dns4/relay.lab/tcp/{RELAY_PORT}/p2p/{self.relay.peer_id}"
            nated = ("--initial-peer", self.relay_maddr, "--auto-relay", "--trusted-relay", relay_dns,
                     "--reachability", "private", *(() if relay_discovery else ("--p2pd-flag=relayDiscovery=false",)))
            # the other three start together (each is a Python with torch and a p2pd: seconds on a busy machine)
            self.pub = self._start("pub", "--initial-peer", self.relay_maddr, "--reachability", "public")
            self.nb = self._start("nb", *nated)
            self.na = self._start("na", *nated)
            for w in (self.pub, self.nb, self.na):
                w.wait_ready()
        except BaseException:
            self.stop()
            raise

    def _start(self, host: str, *args: str) -> Worker:
        w = Worker(self.nat, host, *args)
        self.workers[host] = w
        return w

    @property
    def circuit(self) -> str:
        """nb's address through the relay (dialled at it, the connection can only be relayed)."""
        return f"{self.relay_maddr}/p2p-circuit"

    def stop(self) -> None:
        for w in self.workers.values():
            w.stop()


def start_lab(nat, relay_flags: dict[str, str] | None = None, relay_discovery: bool = False) -> Lab:
    """A Lab, started a second time if a daemon failed to start (seen once in six: a NATed p2pd's "failed to
    connect to bootstrap peers" right after the previous trial's daemons went down)."""
    try:
        return Lab(nat, relay_flags, relay_discovery)
    except BenchError as e:
        print(f"lab start failed, once more: {str(e)[:200]}", flush=True)
        time.sleep(5)
        return Lab(nat, relay_flags, relay_discovery)


def relay_trial(lab: Lab, nbytes: int, reservation_timeout_s: float) -> dict:
    """A relayed connection na -> nb, then `nbytes` pushed over one stream: how far they got."""
    res = lab.nb.call("reservation", reservation_timeout_s + 10, timeout_s=reservation_timeout_s)
    out = {"reservation_s": res["seconds"], "circuit_maddrs": res["maddrs"]}
    if res["seconds"] is None:
        out["outcome"] = f"no reservation within {reservation_timeout_s:.0f} s"
        return out
    conn = lab.na.call("connect", 60, peer=lab.nb.peer_id, maddr=lab.circuit, fresh=True)
    out["connect"] = conn
    if not conn["ok"]:
        out["outcome"] = f"relayed connect failed: {conn['error']}"
        return out
    push = lab.na.call("push", 120, peer=lab.nb.peer_id, nbytes=nbytes, chunk=16 * KIB, interval_s=0.0)
    sunk = lab.nb.call("sunk", 30)
    out.update(push=push, sunk=sunk)
    got = sunk.get("bytes")
    out["relay_counted"] = relayed_bytes(lab.relay.call("logs", 30, pattern=r"relayed \d+ bytes from")["lines"],
                                         lab.na.peer_id, lab.nb.peer_id)
    if got == nbytes and not push["error"]:
        out["outcome"] = f"all {nbytes} bytes through"
    else:
        counted = f"; the relay counted {out['relay_counted']}" if out["relay_counted"] is not None else ""
        out["outcome"] = (f"reset after {got} bytes received ({push['written']} written{counted}; "
                          f"{push['error'] or sunk['error']})")
    out["bytes_received"] = got
    return out


def relayed_bytes(lines: list[str], src: str, dst: str) -> int | None:
    """What the relay host's p2pd says it relayed from `src` to `dst` on one circuit (go-libp2p's relay logs
    "relayed N bytes from A to B" at debug level when a circuit ends): the largest such N, None if none was logged.
    A reset drops what was in flight, so this is the exact cut where the sink's count is a lower bound."""
    best = None
    for line in lines:
        m = re.search(r"relayed (\d+) bytes from (\S+) to (\S+?)\W*$", _msg(line))
        if m and m.group(2) == src and m.group(3) == dst:
            best = max(best or 0, int(m.group(1)))
    return best


def time_limit_trial(lab: Lab, duration_s: float) -> dict:
    """A trickle (1 KiB every 5 s, far below any byte limit) over a fresh relayed connection: when is it cut?
    (A relay's limits are per relayed connection, and the byte trial before this one may have used it up.)"""
    conn = lab.na.call("connect", 60, peer=lab.nb.peer_id, maddr=lab.circuit, fresh=True)
    if not conn["ok"]:
        return {"outcome": f"relayed connect failed: {conn['error']}"}
    push = lab.na.call("push", duration_s + 60, peer=lab.nb.peer_id, nbytes=int(duration_s / 5 + 1) * KIB,
                       chunk=KIB, interval_s=5.0)
    sunk = lab.nb.call("sunk", 30)
    if push["error"] or sunk.get("bytes") != push["written"]:
        outcome = (f"cut after {sunk.get('seconds') or push['seconds']:.0f} s, {sunk.get('bytes')} bytes received "
                   f"({push['error'] or sunk.get('error')})")
    else:
        outcome = f"open for the whole {push['seconds']:.0f} s"
    return {"push": push, "sunk": sunk, "outcome": outcome}


def answered_at(trial: dict) -> int | None:
    """The byte count to read the answering relay off: all bytes through says nothing of a limit but that it is
    above the payload; a cut one is read at the relay's own count where it logged one (the sink lost what was in
    flight). The relay's count is used only for a cut: an uncut circuit is still open and logged nothing, and what
    it did log then is another, earlier circuit between the two (a DHT request, a few KiB)."""
    got = trial.get("bytes_received")
    if got is not None and got == trial.get("push", {}).get("written") and not trial["push"]["error"]:
        return got
    return trial.get("relay_counted") or got


def which_relay(received: int | None, configured_limit: int | None) -> str:
    """Read the answering relay off where the stream was cut."""
    if received is None:
        return "none answered"
    if received < GO_RELAY_DEFAULT_BYTES + 16 * KIB:
        return "go-libp2p default relay (128 KiB / 2 min per circuit)"
    if configured_limit is not None and received < configured_limit + 64 * KIB:
        return f"p2pd's configured relay (-relayDataLimit={configured_limit})"
    return "p2pd's configured relay (limit above the payload)"


def relay_limits(nat, trials: int, payload: int, time_limit: bool, reservation_timeout_s: float,
                 relay_discovery: bool = False, limit_trials: int = 1) -> dict:
    """Relayed transfers with fresh daemons: `trials` with p2pd's defaults, `limit_trials` with -relayDataLimit
    lowered to 1 MiB (does our configuration reach the relay that answers?), one with -relayService=false."""
    lowered = ("relayDataLimit=1MiB", {"relayDataLimit": str(1 << 20)}, 1 << 20)
    variants = ([("defaults", {}, None)] * trials + [lowered] * limit_trials
                + [("relayService=false", {"relayService": "false"}, None)])
    out = []
    for name, flags, limit in variants:
        if out and out[0]["reservation_s"] is None:
            # without a reservation nothing is relayed, and the variants change only the relay's side
            out.append({"variant": name, "relay_flags": flags, "reservation_s": None,
                        "outcome": "skipped: the first trial got no reservation", "answered_by": "-"})
            continue
        lab = start_lab(nat, flags, relay_discovery)
        try:
            t = relay_trial(lab, payload, reservation_timeout_s)
            t.update(variant=name, relay_flags=flags, answered_by=which_relay(answered_at(t), limit))
            # the time limit of the relay that answers without -relayService (go-libp2p's defaults, the one that
            # races the configured one): 2.5 minutes of trickle, once
            if time_limit and name == "relayService=false" and t.get("bytes_received") is not None:
                t["time_limit"] = time_limit_trial(lab, 150.0)
            out.append(t)
            print(f"relay {name}: reservation {t['reservation_s']} s; {t['outcome']}; {t['answered_by']}",
                  flush=True)
        finally:
            lab.stop()
    return {"payload_bytes": payload, "trials": out}


def lab_with_configured_relay(nat, tries: int, reservation_timeout_s: float, relay_discovery: bool) -> Lab:
    """Start labs until the relay host's p2pd answers with its configured relay (which of its two relays answers is
    decided at its start: a tiny-preset push over a circuit goes through, or is cut at 128 KiB); at most `tries`.
    The relayed rows then measure an exchange over the relay that allows one; the last lab is kept either way."""
    tiny = payload_bytes(param_specs("tiny"))
    for k in range(tries):
        lab = start_lab(nat, relay_discovery=relay_discovery)
        trial = relay_trial(lab, tiny, reservation_timeout_s)
        print(f"lab {k + 1}: {trial['outcome']}", flush=True)
        if trial.get("bytes_received") == tiny or k == tries - 1:
            return lab
        lab.stop()
    raise AssertionError("unreachable")


def exchange_rows(nat, presets: list[str], repeats: int, reservation_timeout_s: float,
                  relay_discovery: bool = False, configured_relay_tries: int = 0) -> list[dict]:
    lab = (lab_with_configured_relay(nat, configured_relay_tries, reservation_timeout_s, relay_discovery)
           if configured_relay_tries else start_lab(nat, relay_discovery=relay_discovery))
    rows = []
    try:
        res = lab.nb.call("reservation", reservation_timeout_s + 10, timeout_s=reservation_timeout_s)
        att = lab.nb.call("attach", 40, forwarder=lab.relay.peer_id, timeout_s=30)
        if att["seconds"] is None:
            raise BenchError("nb could not attach to the relay's gasloc forwarder")
        # the address without its /p2p/<id> part: p2pd's connect takes the peer id separately
        pub_maddr = next(m for m in lab.pub.maddrs if f"/ip4/{nat.ip('pub')}/tcp/" in m).split("/p2p/")[0]
        # fresh: pub's DHT may have reached na over na's circuit address already, and p2pd's connect returns at
        # once for a peer it is connected to by any path - the "direct" row then ran over the relay (seen once)
        dialled = lab.na.call("connect", 60, peer=lab.pub.peer_id, maddr=pub_maddr, fresh=True)
        if not dialled["ok"]:
            raise BenchError(f"na cannot dial the public host at {pub_maddr}: {dialled['error']}")
        if not any("p2p-circuit" not in a for a in dialled["addrs"]):
            raise BenchError(f"na has no direct connection to the public host: {dialled['addrs']}")
        relayed = relayed_connect(lab, res)
        rows.append(holepunch_row(lab, relayed))   # DCUtR runs right after the relayed connection opens
        for preset in presets:
            specs = param_specs(preset)
            size = payload_bytes(specs)
            for path, callee, via in (("direct", lab.pub, {}),
                                      ("forwarded", lab.nb, {lab.nb.peer_id: [lab.relay.peer_id]}),
                                      ("relayed", lab.nb, {})):
                key = f"{path}{preset}"
                row = {"path": path, "preset": preset, "payload_bytes": size, "runs": []}
                if path == "relayed":
                    # a fresh relayed connection: the relay's limits are per connection, and its clock runs
                    conn = relayed_connect(lab, res)
                    if not conn["ok"]:
                        rows.append({**row, "outcome": f"no relayed connection: {conn['error']}"})
                        continue
                    row["connections"] = conn["addrs"]
                callee.call("prepare", 60, key=key, specs=specs, via={})
                lab.na.call("prepare", 60, key=key, specs=specs, via=via)
                for _ in range(repeats):
                    callee.call("arm", 30, key=key)
                    run = lab.na.call("go", 600, key=key, peer=callee.peer_id)
                    run["callee"] = callee.call("wait", 60, key=key)
                    row["runs"].append(run)
                    if not run["ok"]:
                        break
                for w in (callee, lab.na):
                    w.call("drop", 30, key=key)
                rows.append(summarize(row))
                print(f"{path:9s} {preset:6s} {row['outcome']}", flush=True)
    finally:
        lab.stop()
    return rows


def relayed_connect(lab: Lab, reservation: dict) -> dict:
    if reservation["seconds"] is None:
        return {"ok": False, "error": "nb got no relay reservation"}
    conn = lab.na.call("connect", 60, peer=lab.nb.peer_id, maddr=lab.circuit, fresh=True)
    if conn["ok"] and not all("p2p-circuit" in a for a in conn["addrs"]):
        conn = {"ok": False, "error": f"na reached nb without the relay: {conn['addrs']}"}
    return conn


def summarize(row: dict) -> dict:
    ok = [r["seconds"] for r in row["runs"] if r["ok"]]
    if ok and len(ok) == len(row["runs"]):
        med = statistics.median(ok)
        paths = sorted({r["path"] for r in row["runs"]})
        row.update(outcome="ok", median_s=med, min_s=min(ok), mb_per_s=row["payload_bytes"] / med / 1e6,
                   via=",".join(paths))
    else:
        bad = next(r for r in row["runs"] if not r["ok"])
        row.update(outcome=f"failed: received {bad['bytes_received']} of {row['payload_bytes']} bytes",
                   detail=bad["detail"])
    return row


def holepunch_row(lab: Lab, conn: dict) -> dict:
    """DCUtR: after the relayed connection, did a direct one appear, and what did p2pd log about hole punching?"""
    row = {"path": "holepunch", "preset": "-", "payload_bytes": 0, "runs": []}
    if not conn["ok"]:
        row["outcome"] = f"not attempted: no relayed connection ({conn['error']})"
        return row
    time.sleep(10)        # DCUtR starts when the relayed connection is up; give it time to try
    addrs = lab.na.call("conns", 30, peer=lab.nb.peer_id)["addrs"]
    direct = [a for a in addrs if "p2p-circuit" not in a]
    pattern = r"(?i)hole ?punch|dcutr|public address"
    logs = {h: lab.workers[h].call("logs", 30, pattern=pattern)["lines"][-5:] for h in ("na", "nb")}
    row.update(connections=addrs, p2pd_log=logs)
    if direct:
        row["outcome"] = f"direct connection after DCUtR: {direct}"
    else:
        reason = next((line for h in ("nb", "na") for line in logs[h] if "public address" in line), "")
        # go-libp2p glues the peer id to the message ("...public addresspeer12D3...")
        said = re.sub(r"peer\w+$", "", _msg(reason))
        row["outcome"] = "no direct connection: " + (f"p2pd: {said!r}" if said else "p2pd logged no hole-punch attempt")
    return row


def _msg(line: str) -> str:
    try:
        return json.loads(line).get("msg", line)
    except (ValueError, AttributeError):
        return line


def markdown(result: dict) -> str:
    lines = ["| path | preset | MB each way | median s (min) | MB/s each way | outcome |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        mb = f"{r['payload_bytes'] / 1e6:.1f}" if r["payload_bytes"] else "-"
        t = f"{r['median_s']:.2f} ({r['min_s']:.2f})" if "median_s" in r else "-"
        rate = f"{r['mb_per_s']:.1f}" if "mb_per_s" in r else "-"
        lines.append(f"| {r['path']} | {r['preset']} | {mb} | {t} | {rate} | {r['outcome']} |")
    lim = result.get("relay_limits")
    if lim:
        lines += ["", f"| relay trial ({lim['payload_bytes'] / 1e6:.1f} MB pushed) | reservation s | outcome | "
                  "answered by |", "|---|---|---|---|"]
        for t in lim["trials"]:
            rs = f"{t['reservation_s']:.1f}" if t["reservation_s"] is not None else "-"
            lines.append(f"| {t['variant']} | {rs} | {t['outcome']} | {t['answered_by']} |")
            if "time_limit" in t:
                lines.append(f"| {t['variant']}, 1 KiB every 5 s | - | {t['time_limit']['outcome']} | |")
    return "\n".join(lines)


@click.command()
@click.option("--json", "json_out", type=click.Path(dir_okay=False, writable=True), help="write the results here")
@click.option("--quick", is_flag=True, help="tiny preset, one run per path, one relay trial")
@click.option("--relay-limits", "limits_only", is_flag=True, help="only the relay measurements")
@click.option("--rows-only", is_flag=True, help="only the table of exchanges by path (no relay trials)")
@click.option("--configured-relay-tries", type=click.IntRange(0, 10), default=0, show_default=True,
              help="for the table: start up to this many labs until the relay host answers with p2pd's configured "
                   "relay, so that the relayed rows measure an exchange over it (0: the first lab, either relay)")
@click.option("--push-preset", type=click.Choice(PRESETS), default="tiny", show_default=True,
              help="the relay trials push this preset's parameter bytes over the circuit")
@click.option("--time-limit", is_flag=True, help="also trickle 150 s over a circuit of the relayService=false trial (the default relay's time limit)")
@click.option("--repeats", type=click.IntRange(1, 20), default=3, show_default=True)
@click.option("--trials", type=click.IntRange(0, 20), default=3, show_default=True,
              help="relay trials with p2pd's default flags (each with fresh daemons)")
@click.option("--limit-trials", type=click.IntRange(1, 20), default=1, show_default=True,
              help="relay trials with -relayDataLimit lowered to 1 MiB (which relay answers is decided at each start)")
@click.option("--reservation-timeout-s", type=click.FloatRange(1, 600), default=60, show_default=True)
@click.option("--relay-discovery", is_flag=True,
              help="NATed daemons find relays by discovery (hivemind's default) instead of the relay host as static "
                   "relay: the reservation then waits out go-libp2p's 3-minute boot delay (pass "
                   "--reservation-timeout-s 240)")
def main(json_out, quick, limits_only, rows_only, configured_relay_tries, push_preset, time_limit, repeats, trials, limit_trials, reservation_timeout_s,
         relay_discovery) -> None:
    if limits_only and rows_only:
        raise click.UsageError("--relay-limits and --rows-only exclude each other")
    why = netlab.nat_unavailable_reason()
    if why:
        raise click.ClickException(f"the NAT lab cannot run here: {why}")
    removed = netlab.cleanup(TAG)
    if removed:
        print(f"removed leftovers of an earlier run: {', '.join(removed)}")
    presets = ["tiny"] if quick else list(PRESETS)
    repeats, trials = (1, 1) if quick else (repeats, trials)
    nat = netlab.NatLab(netlab.run_prefix(TAG), public=["relay", "pub"], homes=["na", "nb"])
    result = {"lab": None, "rows": [], "relay_limits": None}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))     # the finally below removes the lab
    try:
        with nat:
            result["lab"] = nat.describe()
            got_one = True
            if not rows_only:
                pushed = payload_bytes(param_specs(push_preset))
                result["relay_limits"] = relay_limits(nat, trials, pushed, time_limit, reservation_timeout_s,
                                                      relay_discovery, limit_trials)
                got_one = any(t["reservation_s"] is not None for t in result["relay_limits"]["trials"])
            if not limits_only:
                result["rows"] = exchange_rows(nat, presets, repeats, reservation_timeout_s if got_one else 10.0,
                                               relay_discovery, configured_relay_tries)
    finally:     # what was measured before a failure is kept
        if json_out:
            Path(json_out).write_text(json.dumps(result, indent=1))
    print(markdown(result))


if __name__ == "__main__":
    main()
