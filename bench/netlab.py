"""A star network of Linux network namespaces for benchmarks with real processes on shaped links.

    hub namespace:   bridge `br0`, one port `p<i>` per node
    node namespace:  `eth0` (veth to p<i>), address <subnet>.<i+1>/24, loopback up

Each node's link is shaped by tbf on BOTH ends of its veth, because a qdisc only shapes egress and this kernel has
neither ingress policing nor netem (docs/hivemind.md §3): `eth0` (node side) limits the node's upload, `p<i>` (hub
side) its download. A transfer between two nodes therefore runs at min(sender's upload, receiver's download).
The veth ends are created directly inside their namespaces and the bridge lives in the hub namespace: nothing is
added to the root namespace, and deleting the namespaces removes every link, bridge and qdisc.

Names carry a per-run prefix `<tag><pid>x` (the PID of the process that built the star), so a crashed run's
leftovers are found by prefix and told apart from a live run's: `cleanup(tag)` removes only namespaces whose
creator PID is gone, after killing any process still running inside them.

Root only (`ip netns`, `tc`). Use:

    with Star(run_prefix("gnl"), [Node("a", 20), Node("b", 2)]) as star:
        subprocess.run(star.exec_argv("a", ["python", "server.py", "--host", star.ip("a")]))
"""
from __future__ import annotations

import glob
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

DEFAULT_SUBNET = "10.213.90"  # a /24 used only inside these namespaces (bench/transport.py uses 10.213.7)
MAX_NODES = 250
_NAME = re.compile(r"^[a-z0-9]{1,8}$")


class NetlabError(RuntimeError):
    """Setting up or using the namespaces failed; the message names the command and its error."""


@dataclass(frozen=True)
class Node:
    """One host of the star. Rates in Mbit/s (10^6 bit/s); `down_mbit` None means the same as `up_mbit`."""
    name: str
    up_mbit: float
    down_mbit: float | None = None

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"node name {self.name!r}: use 1-8 lowercase letters or digits")
        for rate in (self.up_mbit, self.down):
            if not rate > 0:
                raise ValueError(f"node {self.name}: rates must be positive Mbit/s, got {rate}")

    @property
    def down(self) -> float:
        return self.up_mbit if self.down_mbit is None else self.down_mbit


def unavailable_reason() -> str | None:
    """Why a Star cannot be built here (one line), or None when it can."""
    if os.geteuid() != 0:
        return "needs root (ip netns, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`ip netns` does not work here: {r.stderr.strip()}"
    return None


def run_prefix(tag: str = "gnl", pid: int | None = None) -> str:
    """The name prefix of one run: `tag` + creator PID + 'x' (the 'x' ends the PID: 12 is not a prefix of 123)."""
    if not re.match(r"^[a-z]{1,6}$", tag):
        raise ValueError(f"tag {tag!r}: use 1-6 lowercase letters")
    return f"{tag}{os.getpid() if pid is None else pid}x"


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise NetlabError(f"`{' '.join(cmd)}` failed: {r.stderr.strip() or r.stdout.strip()}")
    return r


def tbf_args(rate_mbit: float) -> list[str]:
    """tc arguments for a token bucket at `rate_mbit`. The burst must hold at least one GSO super-packet (veth
    hands tbf up to 64 KiB at once; smaller buckets make tbf split them) and one timer tick of tokens; 200 ms of
    queue keeps TCP from losing packets on the slow links."""
    rate_bps = rate_mbit * 1e6
    burst = max(64 * 1024, int(rate_bps / 8 * 0.004))
    return ["tbf", "rate", f"{max(1, round(rate_mbit * 1000))}kbit", "burst", str(burst), "latency", "200ms"]


class Star:
    """Namespaces `<prefix>hub` and `<prefix><node>` joined as described in the module docstring."""

    def __init__(self, prefix: str, nodes: list[Node], subnet: str = DEFAULT_SUBNET):
        if not 1 <= len(nodes) <= MAX_NODES:
            raise ValueError(f"a star has 1-{MAX_NODES} nodes, got {len(nodes)}")
        names = [n.name for n in nodes]
        if len(set(names)) != len(names) or "hub" in names:
            raise ValueError(f"node names must be unique and not 'hub': {names}")
        if not re.match(r"^\d{1,3}\.\d{1,3}\.\d{1,3}$", subnet):
            raise ValueError(f"subnet {subnet!r}: give the first three octets of a /24, like 10.213.90")
        self.prefix, self.subnet = prefix, subnet
        self.nodes = {n.name: n for n in nodes}
        self._index = {n.name: i for i, n in enumerate(nodes)}
        self.hub = f"{prefix}hub"

    # ------------------------------------------------------------------ names
    def ns(self, node: str) -> str:
        return f"{self.prefix}{self._node(node).name}"

    def ip(self, node: str) -> str:
        return f"{self.subnet}.{self._index[self._node(node).name] + 1}"

    def exec_argv(self, node: str, argv: list[str]) -> list[str]:
        """`argv` run inside the node's namespace (`ip netns exec` execs it: the PID is the program's own)."""
        return ["ip", "netns", "exec", self.ns(node), *argv]

    def _node(self, name: str) -> Node:
        try:
            return self.nodes[name]
        except KeyError:
            raise KeyError(f"no node {name!r} in this star (nodes: {', '.join(self.nodes)})") from None

    # ------------------------------------------------------------------ lifecycle
    def up(self) -> Star:
        """Create everything; on any failure remove what was created and raise NetlabError."""
        try:
            sh("ip", "netns", "add", self.hub)
            sh("ip", "-n", self.hub, "link", "set", "lo", "up")
            sh("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
            sh("ip", "-n", self.hub, "link", "set", "br0", "up")
            for name, node in self.nodes.items():
                self._add_node(name, node)
        except BaseException:
            self.down()
            raise
        return self

    def _add_node(self, name: str, node: Node) -> None:
        ns, port = self.ns(name), f"p{self._index[name]}"
        sh("ip", "netns", "add", ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        # both ends created in their namespaces at once: no name in the root namespace, no move
        sh("ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port, "netns", self.hub)
        sh("ip", "-n", ns, "addr", "add", f"{self.ip(name)}/24", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        sh("ip", "-n", self.hub, "link", "set", port, "master", "br0")
        sh("ip", "-n", self.hub, "link", "set", port, "up")
        sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", "eth0", "root", *tbf_args(node.up_mbit))
        sh("ip", "netns", "exec", self.hub, "tc", "qdisc", "replace", "dev", port, "root", *tbf_args(node.down))

    def down(self) -> list[str]:
        """Kill whatever still runs inside our namespaces, then delete them (and so every link and qdisc).
        Idempotent; returns the namespaces it removed."""
        return remove_namespaces([ns for ns in list_namespaces() if ns.startswith(self.prefix)])

    def __enter__(self) -> Star:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    def describe(self) -> str:
        return ", ".join(f"{n}={self.ip(n)} up {x.up_mbit:g}/down {x.down:g} Mbit" for n, x in self.nodes.items())


# ---------------------------------------------------------------------------------------------- cleanup
def list_namespaces() -> list[str]:
    r = sh("ip", "netns", "list", check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def namespace_pids(ns: str) -> list[int]:
    r = sh("ip", "netns", "pids", ns, check=False)
    return [int(p) for p in r.stdout.split() if p.isdigit()]


def remove_namespaces(names: list[str], grace_s: float = 10.0) -> list[str]:
    """Stop every process inside each namespace (a namespace outlives `ip netns del` while a process holds it, and
    so would its links), remove the unix sockets and /dev/shm/torch_* files those processes held (hivemind's p2pd
    sockets live in the shared /tmp), then delete the namespaces.

    Order matters for the files: SIGTERM first (a gasloc process shuts down cleanly), SIGKILL after `grace_s`, and
    torch_shm_manager last - it unlinks its clients' /dev/shm files itself once they are gone, even after a kill -9,
    but not if it is killed first."""
    from gasloc.runtime.procs import socket_inodes, unix_socket_paths

    files: set[str] = set()

    def inside() -> list[int]:
        pids = [p for ns in names for p in namespace_pids(ns) if _state(p) not in ("Z", "X")]
        paths = unix_socket_paths()
        for pid in pids:  # note what they hold while they still run: the paths are gone from /proc afterwards
            files.update(paths[i] for i in socket_inodes(pid) if i in paths and paths[i].startswith("/tmp/hivemind"))
            files.update(glob.glob(f"/dev/shm/torch_{pid}_*"))
        return pids

    def is_shm_manager(pid: int) -> bool:
        return _comm(pid).startswith("torch_shm")

    _signal_all([p for p in inside() if not is_shm_manager(p)], signal.SIGTERM)
    _wait_until(lambda: not [p for p in inside() if not is_shm_manager(p)], grace_s)
    _signal_all([p for p in inside() if not is_shm_manager(p)], signal.SIGKILL)
    _wait_until(lambda: not inside(), 6.0)  # torch_shm_manager lingers ~3 s after its last client
    _signal_all(inside(), signal.SIGKILL)
    _wait_until(lambda: not inside(), 5.0)
    for f in files:
        try:
            os.unlink(f)
        except FileNotFoundError:
            pass
    removed = []
    for ns in names:
        if sh("ip", "netns", "del", ns, check=False).returncode == 0:
            removed.append(ns)
    return removed


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _wait_until(done, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        time.sleep(0.25)  # each check runs `ip netns pids` per namespace


def _stat_fields(pid: int) -> tuple[str, str]:
    try:
        raw = open(f"/proc/{pid}/stat").read()
    except OSError:
        return "", "X"
    return raw[raw.index("(") + 1: raw.rindex(")")], raw[raw.rindex(")") + 2:].split()[0]


def _state(pid: int) -> str:
    return _stat_fields(pid)[1]


def _comm(pid: int) -> str:
    return _stat_fields(pid)[0]


def cleanup(tag: str = "gnl", include_live: bool = False) -> list[str]:
    """Remove the leftovers of crashed runs: namespaces named `<tag><pid>x...` whose creator PID no longer runs
    (with `include_live`, also those of running creators). Returns the namespaces removed."""
    pattern = re.compile(rf"^{re.escape(tag)}(\d+)x")
    stale = []
    for ns in list_namespaces():
        m = pattern.match(ns)
        if m and (include_live or not os.path.exists(f"/proc/{int(m.group(1))}")):
            stale.append(ns)
    return remove_namespaces(stale)


# ---------------------------------------------------------------------------------------------- probing
_SINK = """
import socket, sys
n = int(sys.argv[2]); s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept(); got = 0
while got < n:
    b = c.recv(1 << 16)
    if not b: break
    got += len(b)
c.sendall(b"k" if got == n else b"x"); c.close()
"""
_SOURCE = """
import socket, sys, time
n = int(sys.argv[3]); c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[4]))
buf = bytes(1 << 16); t0 = time.monotonic(); left = n
while left > 0:
    left -= c.send(buf[:min(left, len(buf))])
ack = c.recv(1)
print(time.monotonic() - t0 if ack == b"k" else -1, flush=True)
"""


def measure_transfer(star: Star, src: str, dst: str, nbytes: int, timeout_s: float = 60.0) -> float:
    """Seconds to send `nbytes` over TCP from node `src` to node `dst` (until the receiver acknowledges all of
    them), with plain Python sockets in the two namespaces. Raises NetlabError on no connectivity or a timeout."""
    py = sys.executable
    sink = subprocess.Popen(star.exec_argv(dst, [py, "-c", _SINK, star.ip(dst), str(nbytes)]),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        ready, _, _ = select.select([sink.stdout], [], [], timeout_s)
        port = sink.stdout.readline().strip() if ready else ""
        if not port.isdigit():
            raise NetlabError(f"sink in {star.ns(dst)} did not start: {sink.stderr.read() if sink.poll() else ''}")
        try:
            r = subprocess.run(star.exec_argv(src, [py, "-c", _SOURCE, star.ip(dst), port, str(nbytes),
                                                    str(timeout_s)]),
                               capture_output=True, text=True, timeout=timeout_s, start_new_session=True)
        except subprocess.TimeoutExpired:
            raise NetlabError(f"{src} -> {dst}: {nbytes} bytes not through within {timeout_s:.0f} s") from None
        try:
            seconds = float(r.stdout.strip())
        except ValueError:
            raise NetlabError(f"{src} -> {dst} failed: {r.stderr.strip().splitlines()[-1:] or r.stdout}") from None
        if seconds < 0:
            raise NetlabError(f"{src} -> {dst}: the receiver got fewer than {nbytes} bytes")
        return seconds
    finally:
        if sink.poll() is None:
            os.killpg(sink.pid, signal.SIGKILL)
        sink.wait()
        sink.stdout.close()
        sink.stderr.close()
