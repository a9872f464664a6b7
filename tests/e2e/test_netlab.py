"""bench/netlab.py: a 2-node star is connected, shaped on both veth ends, and removed afterwards - also after an
exception inside it, and by `cleanup()` when its creator died. Needs root and `ip netns`."""
from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("netlab", Path(__file__).resolve().parents[2] / "bench" / "netlab.py")
netlab = importlib.util.module_from_spec(_spec)
sys.modules["netlab"] = netlab  # dataclasses look their module up there
_spec.loader.exec_module(netlab)

_why = netlab.unavailable_reason()
# light. Two tests here remove a dead creator's namespaces with netlab.cleanup(tag), which removes every dead
# creator's of that tag: each has a tag of its own (gnc, gnd), since the tests may run at once on different workers
# (xdist_group does not keep a group on one worker under pytest 9: xdist's nodeid suffix is ignored)
pytestmark = [pytest.mark.netns, pytest.mark.skipif(_why is not None, reason=f"network namespaces: {_why}"),
              pytest.mark.light, pytest.mark.xdist_group("netlab")]

MB = 1_000_000


def _ours(prefix: str) -> list[str]:
    return [ns for ns in netlab.list_namespaces() if ns.startswith(prefix)]


@pytest.mark.timeout(120)
def test_star_connects_shapes_and_cleans_up():
    # a: fast upload, slow download (4 Mbit); b: fast both ways. So a -> b runs at 40 Mbit and b -> a at 4 Mbit:
    # the slow direction is shaped only by the hub-side qdisc, the fast one only by node-side ones.
    prefix = netlab.run_prefix("gnt")
    star = netlab.Star(prefix, [netlab.Node("a", 40, 4), netlab.Node("b", 40)])
    with star:
        assert sorted(_ours(prefix)) == sorted([star.hub, star.ns("a"), star.ns("b")])
        assert star.ip("a") != star.ip("b")
        fast = netlab.measure_transfer(star, "a", "b", 1 * MB, timeout_s=30)
        slow = netlab.measure_transfer(star, "b", "a", 1 * MB, timeout_s=30)
        # 1 MB at 4 Mbit takes 2 s; at 40 Mbit, 0.2 s. Loose bounds: the machine is shared.
        assert 1.0 < slow < 20, f"b -> a took {slow:.2f} s; expected about 2 s"
        assert slow > 3 * fast, f"download shaping had no effect: a->b {fast:.2f} s, b->a {slow:.2f} s"
        # nothing in the root namespace: the veth ends were created inside the namespaces
        root_links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        assert "br0" not in root_links and prefix not in root_links
    assert _ours(prefix) == []


@pytest.mark.timeout(60)
def test_star_removed_after_exception_and_processes_inside_are_killed():
    prefix = netlab.run_prefix("gnt")
    star = netlab.Star(prefix, [netlab.Node("a", 10), netlab.Node("b", 10)])
    sleeper = None
    with pytest.raises(RuntimeError, match="boom"):
        with star:
            sleeper = subprocess.Popen(
                star.exec_argv("a", [sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)"]),
                stdout=subprocess.PIPE, text=True)
            # inside the namespace before the exception: `ip netns exec` enters it only after it starts, and one
            # that entered after down()'s SIGTERM scan met only its SIGKILL (CI saw -9 once)
            assert sleeper.stdout.readline().strip() == "ready"
            raise RuntimeError("boom")
    assert _ours(prefix) == []
    # stopped by down(): a namespace outlives its deletion while a process is inside
    assert sleeper.wait(timeout=10) == -signal.SIGTERM
    sleeper.stdout.close()


@pytest.mark.timeout(60)
def test_cleanup_removes_only_namespaces_of_dead_creators():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = netlab.Star(netlab.run_prefix("gnc", pid=dead.pid), [netlab.Node("a", 10)]).up()
    live = netlab.Star(netlab.run_prefix("gnc"), [netlab.Node("a", 10)]).up()
    try:
        removed = netlab.cleanup("gnc")
        assert sorted(removed) == sorted([stale.hub, stale.ns("a")])
        assert sorted(_ours(live.prefix)) == sorted([live.hub, live.ns("a")])
    finally:
        stale.down()
        live.down()
    assert _ours(stale.prefix) == [] and _ours(live.prefix) == []


def test_bad_topologies_are_refused():
    with pytest.raises(ValueError, match="unique"):
        netlab.Star("gntx", [netlab.Node("a", 1), netlab.Node("a", 2)])
    with pytest.raises(ValueError, match="positive"):
        netlab.Node("a", 0)
    with pytest.raises(ValueError, match="lowercase"):
        netlab.Node("Bad-Name", 1)


@pytest.mark.timeout(120)
@pytest.mark.skipif(netlab.nat_unavailable_reason() is not None, reason=f"{netlab.nat_unavailable_reason()}")
def test_nat_lab_routers_masquerade_block_inbound_and_forward_ports_on_request():
    prefix = netlab.run_prefix("gnt")
    lab = netlab.NatLab(prefix, public=["pub"], homes=["h1", "h2"], forward_ports={"h2": 4002})
    with lab:
        pub, h1, h2 = lab.ip("pub"), lab.ip("h1"), lab.ip("h2")
        # out of a home: fine (MASQUERADE); the public side sees the router's address, not the LAN one
        assert netlab.can_connect(lab, "h1", "pub", pub, 4001)
        # into a home: nobody outside reaches the LAN address, nor the router without a forward
        assert not netlab.can_connect(lab, "pub", "h1", h1, 4001)
        assert not netlab.can_connect(lab, "pub", "h1", lab.wan_ip("h1"), 4001)
        assert not netlab.can_connect(lab, "h2", "h1", lab.wan_ip("h1"), 4001)
        assert not netlab.can_connect(lab, "h1", "h2", h2, 4002)
        # the control: h2's router forwards port 4002, so the internet (and the other home) reaches h2
        assert netlab.can_connect(lab, "pub", "h2", lab.wan_ip("h2"), 4002)
        assert netlab.can_connect(lab, "h1", "h2", lab.wan_ip("h2"), 4002)
        # ... until the forward is removed (what the re-probe test does to a running peer)
        lab.unforward("h2")
        assert not netlab.can_connect(lab, "pub", "h2", lab.wan_ip("h2"), 4002)
        with pytest.raises(netlab.NetlabError, match="no port is forwarded"):
            lab.unforward("h2")
        hosts = open(f"/etc/netns/{lab.ns('h1')}/hosts").read()
        assert f"{pub} pub.lab" in hosts
        seen = subprocess.run(lab.exec_argv("h1", ["getent", "hosts", "pub.lab"]), capture_output=True, text=True)
        assert pub in seen.stdout
    assert _ours(prefix) == []
    assert not any(d.startswith(prefix) for d in os.listdir("/etc/netns"))


@pytest.mark.timeout(60)
@pytest.mark.skipif(netlab.nat_unavailable_reason() is not None, reason=f"{netlab.nat_unavailable_reason()}")
def test_nat_lab_leftovers_of_a_dead_creator_are_removed():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    prefix = netlab.run_prefix("gnd", pid=dead.pid)
    netlab.NatLab(prefix, public=["pub"], homes=["h1"]).up()
    assert len(_ours(prefix)) == 4  # hub, pub, router, home
    netlab.cleanup("gnd")
    assert _ours(prefix) == [] and not [d for d in os.listdir("/etc/netns") if d.startswith(prefix)]


def test_bad_nat_labs_are_refused():
    with pytest.raises(ValueError, match="not homes"):
        netlab.NatLab("gntx", ["pub"], ["h1"], forward_ports={"pub": 1})
    with pytest.raises(ValueError, match="r<number>"):
        netlab.NatLab("gntx", ["pub"], ["r0"])
