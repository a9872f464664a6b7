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

`NatLab` builds the other topology: an "internet" of public hosts and homes behind NAT routers (iptables).

Root only (`ip netns`, `tc`; `iptables` for NatLab). Use:

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


# ---------------------------------------------------------------------------------------------- NAT lab
NAT_SUBNET = "10.77"  # a /16 used only inside these namespaces: 10.77.0.0/24 "internet", 10.77.<k>.0/24 home k


class NatLab:
    """An "internet" with public hosts and homes behind NAT routers, for peers behind NAT.

        hub namespace:     bridge `br0`: the internet, 10.77.0.0/24
        public host <p>:   `eth0` on br0, 10.77.0.<i+1>
        router r<k>:       `wan0` on br0, 10.77.0.<101+k>; `lan0` 10.77.<k+1>.1/24; IP forwarding on; iptables:
                           MASQUERADE out of wan0, FORWARD policy DROP, lan0 -> wan0 allowed, wan0 -> lan0 only for
                           ESTABLISHED/RELATED (a home router: nobody outside can open a connection inside)
        home host <h>:     `eth0` 10.77.<k+1>.2/24 behind r<k>, default route via the router

    `forward_ports` {home host: port}: the control, a router that forwards TCP and UDP `port` of its WAN address to
    the host (DNAT) - what a user does by hand. Private address ranges only: real public reachability cannot be
    had, so `hosts_names` writes /etc/netns/<ns>/hosts in every namespace of the lab (`ip netns exec` bind-mounts it
    over /etc/hosts) with `<name>.lab` for each public host; a peer that needs a public-looking address (a relay
    announcing a DNS name, with force_reachability) can use it. Everything lives in namespaces named by `prefix`
    (and their /etc/netns folders): `down()` and `cleanup()` remove them as they remove a Star's.
    """

    def __init__(self, prefix: str, public: list[str], homes: list[str], *, forward_ports: dict[str, int] | None = None,
                 hosts_names: bool = True):
        names = [*public, *homes]
        for n in names:
            if not _NAME.match(n) or n == "hub" or re.match(r"^r\d+$", n):
                raise ValueError(f"host name {n!r}: use 1-8 lowercase letters or digits, not 'hub' or r<number>")
        if len(set(names)) != len(names):
            raise ValueError(f"host names must be unique: {names}")
        if not 1 <= len(public) <= 99 or len(homes) > 99:
            raise ValueError("a NAT lab has 1-99 public hosts and at most 99 homes")
        unknown = set(forward_ports or {}) - set(homes)
        if unknown:
            raise ValueError(f"forward_ports names hosts that are not homes: {sorted(unknown)}")
        self.prefix, self.public, self.homes = prefix, list(public), list(homes)
        self.forward_ports = dict(forward_ports or {})
        self.hosts_names = hosts_names
        self.hub = f"{prefix}hub"

    def ns(self, host: str) -> str:
        if host not in self.public and host not in self.homes and not re.match(r"^r\d+$", host):
            raise KeyError(f"no host {host!r} in this lab (hosts: {', '.join(self.public + self.homes)})")
        return f"{self.prefix}{host}"

    def ip(self, host: str) -> str:
        """The host's own address (for a home host: its LAN address, which nobody outside can reach)."""
        if host in self.public:
            return f"{NAT_SUBNET}.0.{self.public.index(host) + 1}"
        k = self.homes.index(host)
        return f"{NAT_SUBNET}.{k + 1}.2"

    def wan_ip(self, host: str) -> str:
        """The address the internet sees for `host`: its own for a public host, its router's for a home host."""
        if host in self.public:
            return self.ip(host)
        return f"{NAT_SUBNET}.0.{101 + self.homes.index(host)}"

    def exec_argv(self, host: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns(host), *argv]

    def up(self) -> NatLab:
        """Create everything; on any failure remove what was created and raise NetlabError."""
        try:
            sh("ip", "netns", "add", self.hub)
            sh("ip", "-n", self.hub, "link", "set", "lo", "up")
            sh("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
            sh("ip", "-n", self.hub, "link", "set", "br0", "up")
            for i, host in enumerate(self.public):
                self._wire(self.ns(host), "eth0", f"p{i}", f"{self.ip(host)}/24")
            for k, host in enumerate(self.homes):
                self._add_home(k, host)
            if self.hosts_names:
                self._write_hosts()
        except BaseException:
            self.down()
            raise
        return self

    def _wire(self, ns: str, dev: str, port: str, cidr: str) -> None:
        """A new namespace whose `dev` is plugged into the hub bridge at `port`, with address `cidr`."""
        sh("ip", "netns", "add", ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "link", "add", dev, "netns", ns, "type", "veth", "peer", "name", port, "netns", self.hub)
        sh("ip", "-n", ns, "addr", "add", cidr, "dev", dev)
        sh("ip", "-n", ns, "link", "set", dev, "up")
        sh("ip", "-n", self.hub, "link", "set", port, "master", "br0")
        sh("ip", "-n", self.hub, "link", "set", port, "up")

    def _add_home(self, k: int, host: str) -> None:
        router, home = self.ns(f"r{k}"), self.ns(host)
        lan_gw, host_ip, wan = f"{NAT_SUBNET}.{k + 1}.1", self.ip(host), self.wan_ip(host)
        self._wire(router, "wan0", f"w{k}", f"{wan}/24")
        sh("ip", "netns", "add", home)
        sh("ip", "-n", home, "link", "set", "lo", "up")
        sh("ip", "link", "add", "lan0", "netns", router, "type", "veth", "peer", "name", "eth0", "netns", home)
        sh("ip", "-n", router, "addr", "add", f"{lan_gw}/24", "dev", "lan0")
        sh("ip", "-n", router, "link", "set", "lan0", "up")
        sh("ip", "-n", home, "addr", "add", f"{host_ip}/24", "dev", "eth0")
        sh("ip", "-n", home, "link", "set", "eth0", "up")
        sh("ip", "-n", home, "route", "add", "default", "via", lan_gw)
        ipt = ["ip", "netns", "exec", router, "iptables"]
        sh("ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        sh(*ipt, "-t", "nat", "-A", "POSTROUTING", "-o", "wan0", "-j", "MASQUERADE")
        sh(*ipt, "-P", "FORWARD", "DROP")
        sh(*ipt, "-A", "FORWARD", "-i", "lan0", "-o", "wan0", "-j", "ACCEPT")
        sh(*ipt, "-A", "FORWARD", "-i", "wan0", "-o", "lan0", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED",
           "-j", "ACCEPT")
        if host in self.forward_ports:
            self._forward_rules(host, "-A")

    def _forward_rules(self, host: str, op: str) -> None:
        """Add (`-A`) or delete (`-D`) the port forward of `host`'s router: DNAT of its WAN port to the host, and
        the FORWARD rule that lets those new connections in."""
        k, port, host_ip = self.homes.index(host), self.forward_ports[host], self.ip(host)
        ipt = ["ip", "netns", "exec", self.ns(f"r{k}"), "iptables"]
        for proto in ("tcp", "udp"):
            sh(*ipt, "-t", "nat", op, "PREROUTING", "-i", "wan0", "-p", proto, "--dport", str(port), "-j",
               "DNAT", "--to-destination", f"{host_ip}:{port}")
            sh(*ipt, op, "FORWARD", "-i", "wan0", "-o", "lan0", "-p", proto, "-d", host_ip, "--dport",
               str(port), "-m", "conntrack", "--ctstate", "DNAT", "-j", "ACCEPT")

    def unforward(self, host: str) -> None:
        """Stop forwarding `host`'s port (a router reset, a user who closed it): new connections from outside are
        refused from now on; connections already open stay up (ESTABLISHED), as on a real router."""
        if host not in self.forward_ports:
            raise NetlabError(f"{host}: no port is forwarded to it (forward_ports: {self.forward_ports})")
        self._forward_rules(host, "-D")
        del self.forward_ports[host]

    def _namespaces(self) -> list[str]:
        return [self.hub, *(self.ns(h) for h in self.public + self.homes),
                *(self.ns(f"r{k}") for k in range(len(self.homes)))]

    def _write_hosts(self) -> None:
        lines = ["127.0.0.1 localhost", *(f"{self.ip(p)} {p}.lab" for p in self.public)]
        for ns in self._namespaces():
            d = os.path.join(ETC_NETNS, ns)
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, "hosts"), "w") as f:
                f.write("\n".join(lines) + "\n")

    def down(self) -> list[str]:
        """Kill whatever runs inside, delete the namespaces and their /etc/netns folders. Idempotent."""
        return remove_namespaces([ns for ns in list_namespaces() if ns.startswith(self.prefix)],
                                 etc_prefix=self.prefix)

    def __enter__(self) -> NatLab:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    def describe(self) -> str:
        pub = ", ".join(f"{p}={self.ip(p)}" for p in self.public)
        homes = ", ".join(f"{h}={self.ip(h)} behind {self.wan_ip(h)}"
                          + (f" (port {self.forward_ports[h]} forwarded)" if h in self.forward_ports else "")
                          for h in self.homes)
        return f"public: {pub}; behind NAT: {homes}"


def nat_unavailable_reason() -> str | None:
    """Why a NatLab cannot be built here (one line), or None when it can."""
    why = unavailable_reason()
    if why is None and shutil.which("iptables") is None:
        why = "`iptables` is not installed (apt-get install iptables)"
    return why


# ---------------------------------------------------------------------------------------------- cleanup
ETC_NETNS = "/etc/netns"

def list_namespaces() -> list[str]:
    r = sh("ip", "netns", "list", check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def namespace_pids(ns: str) -> list[int]:
    r = sh("ip", "netns", "pids", ns, check=False)
    return [int(p) for p in r.stdout.split() if p.isdigit()]


def remove_namespaces(names: list[str], grace_s: float = 10.0, etc_prefix: str | None = None) -> list[str]:
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
    # /etc/netns/<ns> (a NatLab's hosts files): ours by name, also where the namespace itself is already gone
    for ns in set(names) | set(_etc_dirs(etc_prefix) if etc_prefix else ()):
        shutil.rmtree(os.path.join(ETC_NETNS, ns), ignore_errors=True)
    return removed


def _etc_dirs(prefix: str) -> list[str]:
    try:
        return [d for d in os.listdir(ETC_NETNS) if d.startswith(prefix)]
    except FileNotFoundError:
        return []


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
    def dead(name: str) -> bool:
        m = pattern.match(name)
        return bool(m) and (include_live or not os.path.exists(f"/proc/{int(m.group(1))}"))

    removed = remove_namespaces([ns for ns in list_namespaces() if dead(ns)])
    for d in _etc_dirs(tag):  # a NatLab's hosts files whose namespaces are already gone
        if dead(d):
            shutil.rmtree(os.path.join(ETC_NETNS, d), ignore_errors=True)
    return removed


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


_LISTEN = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", int(sys.argv[1])))
s.listen(4); print("up", flush=True)
while True:
    c, _ = s.accept(); c.sendall(b"k"); c.close()
"""
_DIAL = """
import socket, sys
try:
    c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))
    print("ok" if c.recv(1) == b"k" else "no")
except OSError as e:
    print("no", e)
"""


def can_connect(lab, src: str, dst: str, address: str, port: int, timeout_s: float = 2.0) -> bool:
    """Does a TCP connection from host `src` to `address:port` reach a listener on host `dst` (port `port`)?
    `lab`: a Star or NatLab (anything with exec_argv)."""
    py = sys.executable
    server = subprocess.Popen(lab.exec_argv(dst, [py, "-c", _LISTEN, str(port)]), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        ready, _, _ = select.select([server.stdout], [], [], 30)
        if not ready or server.stdout.readline().strip() != "up":
            raise NetlabError(f"listener on {dst}:{port} did not start: {server.stderr.read() if server.poll() else ''}")
        r = subprocess.run(lab.exec_argv(src, [py, "-c", _DIAL, address, str(port), str(timeout_s)]),
                           capture_output=True, text=True, timeout=timeout_s + 30, start_new_session=True)
        return r.stdout.strip() == "ok"
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
        server.stdout.close()
        server.stderr.close()
