"""Peers behind NAT, on the NAT lab (bench/netlab.py NatLab): a bootstrap and 2 public peers on the "internet", and
2 peers behind two separate home routers (MASQUERADE, nothing forwarded in). Real gasloc processes, tiny model.

What must hold: each NATed peer learns it is behind NAT (one by the dial-back probe, one from the config), joins by
downloading the state, pairs >= 3 times, at least once with the other NATed peer (through a forwarder: the metrics
name it) and once with a public peer, and completes >= 90% of the public peers' rounds in the same time; the public
peers never dial a NATed one directly (only through a forwarder); gasloc doctor says which host is behind NAT. A peer
whose port forward goes away while it runs learns it by probing again, and attaches to the bootstrap. Needs root,
`ip netns` and iptables."""
from __future__ import annotations

import importlib.util
import re
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from e2e.harness import Harness, child_env
from e2e.swarm_helpers import rounds, start_event, write_config
from gasloc.runtime.procs import gasloc_argv

_spec = importlib.util.spec_from_file_location("netlab", Path(__file__).resolve().parents[2] / "bench" / "netlab.py")
netlab = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("netlab", netlab)
_spec.loader.exec_module(netlab)

_why = netlab.nat_unavailable_reason()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(_why is not None, reason=f"NAT lab: {_why}")]

ANY = "/ip4/0.0.0.0/tcp/0"
PUBLIC, NATED = ["pa", "pb"], ["na", "nb"]


@pytest.fixture
def lab():
    lab = netlab.NatLab(netlab.run_prefix("gnx"), public=["boot", *PUBLIC], homes=NATED)
    lab.up()
    try:
        yield lab
    finally:
        lab.down()


def spawn_in(h: Harness, lab, host: str, name: str, *args):
    argv = lab.exec_argv(host, gasloc_argv(*map(str, args)))
    return h.sup.start(name, argv, h.run_dir / f"{name}.log", env=child_env(), cwd=h.run_dir)


def lab_maddr(maddrs: list[str], ip: str) -> str:
    return next(m for m in maddrs if f"/ip4/{ip}/" in m)


@pytest.mark.timeout(360)   # ~60 s on an idle machine; 203 s seen at a load average of 44
def test_two_nated_peers_pair_with_each_other_and_with_public_peers(lab, harness):
    h = harness
    config = write_config(h, deadline_s=1.2)
    boot = spawn_in(h, lab, "boot", "bootstrap", "bootstrap", "--host-maddrs", ANY, "--run-id", "e2e")
    ready = h.wait_ready(boot, 90)
    boot_addr = lab_maddr(ready["maddrs"], lab.ip("boot"))

    def peer(host: str, *extra: str):
        return spawn_in(h, lab, host, host, "peer", "--config", config, "--initial-peers", boot_addr,
                        "--host-maddrs", ANY, "--run-dir", h.dir(host), *extra)

    ids = {"boot": ready["peer_id"]}
    pub = {n: peer(n) for n in PUBLIC}
    ids.update({n: h.wait_ready(c, 150)["peer_id"] for n, c in pub.items()})
    # na learns it by the probe; nb is told (and so also runs its DHT in client mode)
    nat = {"na": peer("na"), "nb": peer("nb", "--reachability", "private")}
    ids.update({n: h.wait_ready(c, 150)["peer_id"] for n, c in nat.items()})
    names = {v: k for k, v in ids.items()}

    starts = {n: start_event(h, n) for n in [*PUBLIC, *NATED]}
    for n in PUBLIC:
        assert starts[n]["reachability"] == "public", starts[n]
    assert starts["na"]["reachability"] == "private" and starts["na"]["reachability_source"].startswith("probe("), \
        starts["na"]
    assert starts["nb"]["reachability"] == "private" and starts["nb"]["reachability_source"] == "config"
    # behind NAT the DHT node is a client (hosts no keys), also where only the probe told (na restarted it)
    for n in [*PUBLIC, *NATED]:
        assert starts[n]["dht_mode"] == ("client" if n in NATED else "server"), (n, starts[n])
    assert "dht_restarted mode=client" in h.log("na") and "dht_restarted" not in h.log("nb")
    for n in NATED:  # joined late, from behind NAT: the state came from another peer of the running swarm (a NATed
        # one too, once it is a member: nb joined from na in one fresh-clone run, through the bootstrap's forwarder)
        assert names.get(starts[n]["joined_from"]) in [*PUBLIC, *NATED] and names[starts[n]["joined_from"]] != n, \
            starts[n]
    # the window opens once each NATed peer has finished 3 rounds: the first rounds of a peer that just started
    # (state loaded, first steps slower) are the cost of any late joiner, not of NAT, and they counted against the
    # NATed peers alone (the public peers were warm)
    h.wait_until(lambda: all(len(rounds(h, n)) >= 3 for n in NATED), 120, "3 rounds of each NATed peer",
                 alive=(*PUBLIC, *NATED))
    t0 = time.time()

    def ok_with(n: str) -> Counter:
        return Counter(names.get(r["partner"], "?") for r in rounds(h, n) if r["outcome"] == "ok" and r["time"] > t0)

    def done() -> bool:
        # enough rounds in the window for the 90% comparison below to mean something
        # (30: one round is then 3% of the comparison; with 10 a run at load average 44 saw 8-9 against 10)
        if min(sum(1 for r in rounds(h, n) if r["time"] > t0) for n in PUBLIC) < 30:
            return False
        for n, other in (("na", "nb"), ("nb", "na")):
            got = ok_with(n)
            if sum(got.values()) < 3 or got[other] < 1 or not any(got[p] for p in PUBLIC):
                return False
        return True

    h.wait_until(done, 180, "each NATed peer: >= 3 ok exchanges, >= 1 with the other NATed peer and >= 1 with a "
                 "public one, and 30 public rounds", alive=(*PUBLIC, *NATED))
    t1 = time.time()

    for n in NATED:
        rs = [r for r in rounds(h, n) if r["time"] > t0]
        assert rs[-1]["reach"] == "relayed" and rs[-1]["via"] >= 1, rs[-1]
        other = "nb" if n == "na" else "na"
        paths = [r["path"] for r in rs if r["outcome"] == "ok" and names.get(r["partner"]) == other]
        # the NAT <-> NAT exchanges went through a public peer or the bootstrap, and the metrics say which
        assert paths and all(p.startswith("forwarded:") and names[p.split(":", 1)[1]] in ["boot", *PUBLIC]
                             for p in paths), paths
        # with a public peer: direct when the NATed peer called (or the public peer is its forwarder), else through
        # its forwarder
        assert all(r["path"] == "direct" or names[r["path"].split(":", 1)[1]] in ["boot", *PUBLIC]
                   for r in rs if r["outcome"] == "ok" and names.get(r["partner"]) in PUBLIC)

    # whoever forwarded counted it (the bootstrap logs no rounds); no public peer's dial of a NATed one timed out
    forwarders = {names[p.split(":", 1)[1]] for n in NATED for r in rounds(h, n) if (p := r.get("path") or "")
                  .startswith("forwarded:")}
    for n in forwarders & set(PUBLIC):
        assert rounds(h, n)[-1]["forwarded_bytes"] > 0
    for n in PUBLIC:
        assert "deadline passed during connect" not in h.log(n)

    # gasloc doctor, run on a NATed host and on a public one, asks the bootstrap to dial it back
    for host, verdict, fix in (("nb", "WARN behind NAT", "forward TCP port 4100"), ("pa", "OK reachable", "")):
        r = subprocess.run(lab.exec_argv(host, gasloc_argv("doctor", "--initial-peers", boot_addr, "--run-id", "e2e",
                                                           "--port", "4100", "--checkpoint-dir", h.dir("doc"))),
                           capture_output=True, text=True, timeout=120, env=child_env(), start_new_session=True)
        flat = " ".join(r.stdout.split())
        status, first = verdict.split(" ", 1)
        assert r.returncode == 0 and f"reachability │ {status} │ {first}" in flat and fix in flat, r.stdout + r.stderr

    # keeping up. NAT can cost a peer time only where it talks: the wait for a partner (public peers call NATed ones
    # through forwarders) and the transfer. Inner steps are local work, yet on 2 shared cores identical peers' inner
    # steps differ by 8-19% in one run (CPU scheduling; CI, 2026-12-01: public peers at 1.42 and 1.685 rounds/s), and
    # raw round rates carried that noise into the verdict (CI, 2026-12-03: NATed 0.87 and 0.85 of the slower public
    # peer). So a peer's pace is the swarm's mean inner-step time per round plus its own communication time per round
    # (round_s - compute_s), over the window; a NATed peer keeps at least 90% of the slower public peer's pace (the
    # issue's 90%). Raw rates are printed beside it. Before public peers called NATed ones through their forwarders,
    # NATed peers waited 0.56 s per round against 0.17 s and finished 14-17 of 20 rounds (docs/nat.md).
    window = {n: [r for r in rounds(h, n) if t0 < r["time"] <= t1] for n in [*PUBLIC, *NATED]}
    compute_s = statistics.mean(r["compute_s"] for rs in window.values() for r in rs)
    pace = {n: 1 / (compute_s + statistics.mean(r["round_s"] - r["compute_s"] for r in rs)) for n, rs in window.items()}

    def per_s(n: str) -> float:   # raw rate: rounds from the first to the last in the window, over that time
        ts = [r["time"] for r in window[n]]
        return (len(ts) - 1) / (ts[-1] - ts[0])
    rates = {n: per_s(n) for n in window}
    public_pace, public_rate = min(pace[n] for n in PUBLIC), min(rates[n] for n in PUBLIC)
    print("nat-summary", summary(h, [*PUBLIC, *NATED], names, t0, t1),    # docs/nat.md quotes these (pytest -s)
          "pace-vs-public", {n: round(pace[n] / public_pace, 3) for n in NATED},
          "rate-vs-public", {n: round(rates[n] / public_rate, 3) for n in NATED})
    for n in NATED:
        assert pace[n] >= 0.9 * public_pace, ({k: round(v, 3) for k, v in pace.items()},
                                              {k: round(v, 3) for k, v in rates.items()})


def summary(h: Harness, peers: list[str], names: dict[str, str], t0: float, t1: float) -> dict:
    """Per peer, over the window (t0, t1]: rounds, ok exchanges by partner and by path (forwarders by name)."""
    out = {}
    for n in peers:
        rs = [r for r in rounds(h, n) if t0 < r["time"] <= t1]
        oks = [r for r in rs if r["outcome"] == "ok"]
        path = Counter(p if p == "direct" else "forwarded:" + names.get(p.split(":", 1)[1], "?")
                       for r in oks if (p := r.get("path") or "direct"))
        out[n] = {"rounds": len(rs), "ok": len(oks), "partners": dict(Counter(names.get(r["partner"], "?")
                                                                          for r in oks)), "paths": dict(path)}
    return out


@pytest.fixture
def nat_only_lab():
    lab = netlab.NatLab(netlab.run_prefix("gnx"), public=["boot"], homes=["n1", "n2", "n3"])
    lab.up()
    try:
        yield lab
    finally:
        lab.down()


@pytest.mark.timeout(420)
def test_a_swarm_of_nated_peers_only_pairs_through_the_bootstrap(nat_only_lab, harness):
    """A public bootstrap and 3 peers behind 3 NATs, nobody told anything: each learns from the bootstrap's probe
    that it is behind NAT (and runs its DHT as a client), attaches to the bootstrap, and pairs >= 3 times with the
    others through it. The third starts late: the only trained peers are behind NAT, so it downloads the state
    from one of them through the bootstrap."""
    h, lab, homes = harness, nat_only_lab, nat_only_lab.homes
    first, late = homes[:2], homes[2]
    config = write_config(h, deadline_s=1.2)
    boot = spawn_in(h, lab, "boot", "bootstrap", "bootstrap", "--host-maddrs", ANY, "--run-id", "e2e")
    ready = h.wait_ready(boot, 90)
    boot_addr = lab_maddr(ready["maddrs"], lab.ip("boot"))

    def peer(n: str):
        return spawn_in(h, lab, n, n, "peer", "--config", config, "--initial-peers", boot_addr,
                        "--host-maddrs", ANY, "--run-dir", h.dir(n))
    kids = {n: peer(n) for n in first}
    ids = {n: h.wait_ready(c, 150)["peer_id"] for n, c in kids.items()}
    # the donors must have trained (a donor is a peer past round 0) - and pairing once proves the path works
    h.wait_until(lambda: all(any(r["outcome"] == "ok" for r in rounds(h, n)) for n in first), 150,
                 "the first two NATed peers: an ok exchange each", alive=tuple(first))
    kids[late] = peer(late)
    ids[late] = h.wait_ready(kids[late], 150)["peer_id"]
    names = {v: k for k, v in ids.items()}
    for n in homes:
        st = start_event(h, n)
        assert st["reachability"] == "private" and st["reachability_source"] == "probe(0/1 dialled back)", st
        assert st["dht_mode"] == "client", st
    joined = re.search(r"join: state of round (\d+) from (\S+)", h.log(late))
    assert joined and int(joined.group(1)) > 0 and names.get(joined.group(2)) in first, \
        joined and joined.group(0)
    assert names.get(start_event(h, late)["joined_from"]) in first

    def done() -> bool:
        return all(sum(r["outcome"] == "ok" for r in rounds(h, n)) >= 3 for n in homes)
    h.wait_until(done, 180, "every NATed peer: >= 3 ok exchanges", alive=tuple(homes))
    for n in homes:
        oks = [r for r in rounds(h, n) if r["outcome"] == "ok"]
        assert {r["partner"] for r in oks} <= set(ids.values()) - {ids[n]}
        assert all(r["path"] == f"forwarded:{ready['peer_id']}" for r in oks), [r["path"] for r in oks]
    names[ready["peer_id"]] = "boot"
    print("nat-summary", summary(h, homes, names, 0.0, time.time()), "joined", joined.group(0))


@pytest.fixture
def forward_lab():
    lab = netlab.NatLab(netlab.run_prefix("gnx"), public=["boot"], homes=["na"], forward_ports={"na": 4100})
    lab.up()
    try:
        yield lab
    finally:
        lab.down()


@pytest.mark.light        # one peer, alone in its run
@pytest.mark.timeout(180)   # ~30 s on an idle machine
def test_a_peer_whose_port_forward_goes_away_reprobes_and_attaches_to_the_bootstrap(forward_lab, harness):
    """na's router forwards its port and na announces it: the start probe says public. The test removes the
    forward while na trains alone; within a few re-probe periods (2 s here) na says it is behind NAT, keeps its DHT
    server (hivemind cannot switch a running node), attaches to the bootstrap and its rounds say `relayed`."""
    h, lab = harness, forward_lab
    config = write_config(h)
    config.write_text(config.read_text() + "[network]\nreprobe_every_s = 2.0\n")
    boot = spawn_in(h, lab, "boot", "bootstrap", "bootstrap", "--host-maddrs", ANY, "--run-id", "e2e")
    boot_addr = lab_maddr(h.wait_ready(boot, 90)["maddrs"], lab.ip("boot"))
    port = lab.forward_ports["na"]
    na = spawn_in(h, lab, "na", "na", "peer", "--config", config, "--initial-peers", boot_addr,
                  "--host-maddrs", f"/ip4/0.0.0.0/tcp/{port}", "--announce-maddrs", f"/ip4/{lab.wan_ip('na')}/tcp/{port}",
                  "--run-dir", h.dir("na"))
    na_id = h.wait_ready(na, 150)["peer_id"]
    st = start_event(h, "na")
    assert (st["reachability"], st["reachability_source"], st["dht_mode"]) == \
        ("public", "probe(1/1 dialled back)", "server"), st
    # a round, and a re-probe while the forward stands (period 2 s): still public, no change
    h.wait_until(lambda: any(r["reach"] == "direct" for r in rounds(h, "na"))
                 and "reprobe reason=period source=probe(1/1 dialled back) reachability=public" in h.log("na"),
                 60, "na: a round as direct and a re-probe that kept it public", alive=("na",))

    def changes() -> list[dict]:
        return [e for e in h.metrics("na") if e.get("event") == "reachability"]
    assert changes() == []

    lab.unforward("na")
    ev = h.wait_until(lambda: changes(), 30, "na: a reachability event after the forward went away",
                      alive=("na",))[0]
    assert (ev["previous"], ev["reachability"], ev["reachability_source"], ev["reason"], ev["dht_mode"]) == \
        ("public", "private", "probe(0/1 dialled back)", "period", "server"), ev
    assert ("reachability_changed from=public to=private source=probe(0/1 dialled back) reason=period dht=server "
            "(kept until restart)") in h.log("na")
    # attached to the bootstrap (its forwarder), and the rounds after the change say so
    last = h.wait_until(lambda: [r for r in rounds(h, "na") if r["time"] > ev["time"] and r["reach"] == "relayed"],
                        30, "na: a round as relayed after the change", alive=("na",))[-1]
    assert last["via"] == 1, last
    # `via` lists a forwarder from the first try of the attachment on (so the record says relayed at once): the
    # bootstrap accepts it a moment later (in one run 35 ms after a round that already said relayed)
    h.wait_until(lambda: f"relay attached peer={na_id}" in h.log("bootstrap"), 15,
                 "the bootstrap: na's attachment accepted")
    assert len(changes()) == 1   # the re-probes after the change kept it private
