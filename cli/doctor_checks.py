"""The checks of `gasloc doctor`. Each returns Check(name, status, detail, fix): the fix is a concrete action for
WARN and FAIL. Local checks are plain functions; network checks share one throwaway p2pd (`network_checks`)."""
from __future__ import annotations

import asyncio
import errno
import os
import shutil
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from gasloc.runtime.maddrs import address_scope, peer_id_of

OK, WARN, FAIL, SKIP = "OK", "WARN", "FAIL", "SKIP"


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""


# --------------------------------------------------------------------------------------------- local checks
def _port_owner(port: int) -> str:
    """'pid 123 (python)' of a process holding a local TCP/UDP socket on `port`, if /proc tells."""
    inodes = set()
    for table in ("tcp", "tcp6", "udp", "udp6"):
        try:
            lines = Path(f"/proc/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) > 9 and int(parts[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(parts[9])
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    comm = Path(f"/proc/{pid}/comm").read_text().strip()
                    return f"pid {pid} ({comm})"
        except OSError:
            continue
    return "another process"


def check_port(port: int) -> Check:
    """Bind the port as p2pd would (TCP and UDP/QUIC, every interface)."""
    if port == 0:
        return Check("listen port", SKIP, "port 0: the OS picks a free port at start (fine for a private swarm; a "
                     "public peer needs a fixed port to forward)")
    for kind, proto in ((socket.SOCK_STREAM, "tcp"), (socket.SOCK_DGRAM, "udp")):
        with socket.socket(socket.AF_INET, kind) as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return Check("listen port", FAIL, f"{proto}/{port} is in use by {_port_owner(port)}",
                                 f"stop that process, or pick a free port: --port {port + 1} (and forward that one)")
                if e.errno == errno.EACCES:
                    return Check("listen port", FAIL, f"{proto}/{port}: permission denied (ports below 1024 need "
                                 f"root)", "use a port of 1024 or more, e.g. --port 31337")
                return Check("listen port", FAIL, f"{proto}/{port}: {e.strerror}", "pick another --port")
    return Check("listen port", OK, f"tcp/{port} and udp/{port} are free on every interface (reachability from "
                 "outside can only be seen from another machine: run gasloc doctor there with --initial-peers "
                 "<this peer's maddr>)")


def check_dir_writable(path: Path) -> Check:
    """Can the peer create `path` and write files in it? Tries it (a probe file, removed again)."""
    name = "checkpoint dir"
    path = path.expanduser().absolute()
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return Check(name, FAIL, f"{existing} is a file, so {path} cannot be a directory",
                     f"choose another --checkpoint-dir, or move the file {existing} away")
    created = []
    try:
        for d in reversed([path, *path.parents]):
            if not d.exists():
                d.mkdir()
                created.append(d)
        probe = path / f".gasloc-doctor-{uuid.uuid4().hex}"
        probe.write_bytes(b"x" * 4096)
        probe.unlink()
    except OSError as e:
        where = e.filename or path
        fix = {errno.EROFS: f"{where} is on a read-only file system: choose a --checkpoint-dir on a writable disk "
                            f"(or remount it read-write)",
               errno.EACCES: f"give this user write access (chown {os.getuid()} {where}, or chmod u+w {where}) or "
                             f"choose another --checkpoint-dir",
               errno.ENOSPC: "free some disk space or choose a --checkpoint-dir on another disk"}.get(
                   e.errno, "choose another --checkpoint-dir")
        return Check(name, FAIL, f"cannot write in {path}: {e.strerror} ({where})", fix)
    finally:
        for d in reversed(created):
            try:
                d.rmdir()
            except OSError:
                pass
    return Check(name, OK, f"{path} is writable" + (" (will be created)" if created else ""))


def check_disk(path: Path, min_free_gb: float) -> Check:
    existing = path.expanduser().absolute()
    while not existing.exists():
        existing = existing.parent
    free_gb = shutil.disk_usage(existing).free / 1e9
    detail = f"{free_gb:.1f} GB free at {existing}"
    if free_gb < min_free_gb:
        return Check("disk space", FAIL, detail + f" (< {min_free_gb:g} GB)",
                     "free space, or choose a --checkpoint-dir on another disk (checkpoints keep the model, "
                     "its outer state and momentum: about 3x the fp32 model each)")
    if free_gb < 4 * min_free_gb:
        return Check("disk space", WARN, detail, "checkpoints may fill it over a long run: free some space")
    return Check("disk space", OK, detail)


def check_cuda(min_free_gb: float = 2.0) -> Check:
    import torch

    if not torch.cuda.is_available():
        return Check("GPU", WARN, "no CUDA: will train on CPU",
                     "fine for the tiny presets; for a GPU, check nvidia-smi and install a CUDA build of torch")
    parts, low = [], []
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        parts.append(f"cuda:{i} {torch.cuda.get_device_name(i)} {free / 1e9:.1f}/{total / 1e9:.1f} GB free")
        if free / 1e9 < min_free_gb:
            low.append(f"cuda:{i}")
    if low:
        return Check("GPU", WARN, "; ".join(parts), f"{', '.join(low)} has under {min_free_gb:g} GB free: stop "
                     f"other jobs on it (nvidia-smi lists them) or choose a smaller preset")
    return Check("GPU", OK, "; ".join(parts))


def check_memory(peer_config: Path | None) -> Check:
    """Whether a round of the peer's config fits where it will train: the same estimate the peer's start-up check
    begins with (peer/train/memory.py estimate_bytes, in parameter copies plus activations) against the same
    headroom (CUDA: the device's free memory; CPU: run.memory_limit_mb, the cgroup's limit, MemAvailable). The
    peer then measures it with a dry step; this check runs nothing."""
    import torch

    from gasloc.peer.config import PeerConfig
    from gasloc.peer.train.memory import FIT_MARGIN, estimate_bytes, headroom, suggestion
    from gasloc.runtime.config import ConfigError, resolve

    try:
        cfg = resolve(PeerConfig, str(peer_config) if peer_config else None, {}, environ={})
    except ConfigError as e:
        return Check("memory", FAIL, f"{peer_config}: {e}", "fix the peer's config file")
    cuda = cfg.run.device == "cuda" or (cfg.run.device == "auto" and torch.cuda.is_available())
    if cfg.run.device == "cuda" and not torch.cuda.is_available():
        return Check("memory", FAIL, "run.device is 'cuda' but no CUDA device is available",
                     "use run.device = 'auto' or 'cpu', or install a CUDA build of torch")
    device = torch.device("cuda" if cuda else "cpu")
    vocab = 256  # the tokenizer is not loaded here: an HF vocabulary's embeddings are counted at 256 tokens
    need = estimate_bytes(cfg.model, vocab, cfg.data.batch_size, cuda)
    room = headroom(device, cfg.run.memory_limit_mb)
    what = (f"model.preset '{cfg.model.preset}', data.batch_size {cfg.data.batch_size}, model.seq_len "
            f"{cfg.model.seq_len} on {device.type}: a round needs about {need / 1e6:.0f} MB (estimated"
            + ("" if cfg.data.tokenizer == "bytes" else ", embeddings at a 256-token vocabulary")
            + f"), {room.bytes / 1e6:.0f} MB {room.source}")
    if need * FIT_MARGIN > room.bytes:
        return Check("memory", FAIL, what, suggestion(cfg, vocab, cuda, max(room.bytes, 0), 1.0)
                     + "; the peer would refuse to start (it measures with one dry step)")
    return Check("memory", OK, what)


# ------------------------------------------------------------------------------------------- network checks
def check_codec(peer_config: Path | None) -> Check:
    """Which codec the peer's exchanges send (exchange.codec), and what an exchange of its model costs."""
    import torch

    from gasloc.peer.config import PeerConfig
    from gasloc.peer.train.model import build_model
    from gasloc.protocol.codec import FALLBACK_CODEC, parse
    from gasloc.runtime.config import ConfigError, resolve

    try:
        cfg = resolve(PeerConfig, str(peer_config) if peer_config else None, {}, environ={})
    except ConfigError as e:
        return Check("wire codec", FAIL, f"{peer_config}: {e}", "fix the peer's config file")
    c = parse(cfg.exchange.codec)
    # the tensor sizes without allocating the model (meta device); an HF tokenizer's vocabulary is not loaded here,
    # so the embeddings are counted at the byte vocabulary's 256 and the figure says so
    with torch.device("meta"):
        numels = [p.numel() for p in build_model(cfg.model, 256, seed=0).parameters()]
    per = c.bits_per_param(numels) / 8
    vocab = "" if cfg.data.tokenizer == "bytes" else " (embeddings at a 256-token vocabulary)"
    note = "lossless" if c.lossless else "partners mix each other's decoded forms (docs/codecs.md)"
    if c.modulo:   # decoded only against our own codes of the same kind (protocol/codec.py sent_codec)
        note += f"; with a partner of another codec it sends {FALLBACK_CODEC} instead"
    elif c.sparse:   # a partner in any other codec answers BAD_DTYPE: both must send the same blocks
        note += f"; it pairs only with peers that send {c.name} too"
    return Check("wire codec", OK, f"exchange.codec = {c.name}: {8 * per:.2f} bits a parameter; the {cfg.model.preset} "
                 f"model{vocab} sends {sum(numels) * per / 1e6:.1f} MB each way an exchange; {note}; state "
                 "downloads are lossless")


async def _ping(p2p, maddr: str, timeout_s: float, max_skew_s: float) -> list[Check]:
    """Connect to one initial peer, then a DHT ping, whose answer carries the peer's clock (PingResponse.dht_time)."""
    from hivemind.dht.protocol import DHTProtocol
    from hivemind.p2p import PeerID
    from hivemind.proto import dht_pb2
    from hivemind.utils.multiaddr import Multiaddr

    name, at = "initial peer", f"{maddr}: "
    try:
        peer = PeerID.from_base58(peer_id_of(maddr))
        peer.to_bytes()
    except (ValueError, TypeError) as e:
        return [Check(name, FAIL, at + f"the /p2p/ part is not a valid peer id ({e})",
                      "copy the full address again from the node's log or maddrs file")]
    t0 = time.monotonic()
    try:
        # the daemon wants the transport part only; the /p2p/ id travels separately
        await asyncio.wait_for(p2p._client.connect(peer, [Multiaddr(maddr.split("/p2p/")[0])]), timeout_s)
    except TimeoutError:
        return [Check(name, FAIL, at + f"no answer within {timeout_s:g} s",
                      "check that the peer runs and that this address is current (a node started with port 0 gets a "
                      "new one at each start: use its maddrs file); a firewall may drop tcp to its port")]
    except Exception as e:  # the daemon's ControlFailure / P2PDaemonError carry libp2p's reason as text
        reason = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        return [Check(name, FAIL, at + f"cannot connect: {reason}",
                      "check that the peer runs and that this address (ip, port, /p2p/ id) is current: a restarted "
                      "node has a new port unless it uses a fixed --port, and a new id unless it keeps "
                      "--identity-path; ask its operator for its maddrs file")]
    rtt_ms = (time.monotonic() - t0) * 1e3
    stub = super(DHTProtocol, DHTProtocol).get_stub(p2p, peer)  # the DHT's RPC, without a DHT node of our own
    try:
        sent = time.time()
        resp = await asyncio.wait_for(stub.rpc_ping(dht_pb2.PingRequest(validate=False)), timeout_s)
        got = time.time()
    except Exception as e:
        return [Check(name, WARN, at + f"connected in {rtt_ms:.0f} ms, but it does not answer DHT pings "
                      f"({type(e).__name__})", "this address is a libp2p node but not a DHT node: give a peer's or a "
                      "bootstrap node's address")]
    checks = [Check(name, OK, at + f"connected in {rtt_ms:.0f} ms, DHT ping {(got - sent) * 1e3:.0f} ms")]
    if resp.dht_time:
        skew = resp.dht_time - (sent + got) / 2
        half_rtt = (got - sent) / 2  # the uncertainty: we do not know when, within the round trip, it read its clock
        detail = f"{skew:+.3f} s ± {half_rtt:.3f} against {maddr.rsplit('/', 1)[-1][:12]}… (its clock minus ours)"
        fix = "sync the clock with NTP (timedatectl set-ntp true, or chronyc makestep): DHT records expire by " \
              "wall-clock time, so skew makes peers vanish early or linger"
        status = FAIL if abs(skew) > max_skew_s else WARN if abs(skew) > max_skew_s / 3 else OK
        checks.append(Check("clock skew", status, detail, fix if status != OK else ""))
    return checks


async def _reachability(p2p, initial_peers: list[str], maddrs: list[str], run_id: str, timeout_s: float) -> Check:
    """The peer's own start-up question (network.reachability auto), asked of the initial peers: can they dial
    this machine's addresses back? (protocol/reach.py, docs/nat.md)"""
    from gasloc.peer.swarm.forward import ask_probe, probe_addrs
    from gasloc.protocol.messages import PROTOCOL_VERSION
    from gasloc.protocol.reach import probe_verdict

    port = next((int(m.split("/tcp/")[1].split("/")[0]) for m in maddrs if "/tcp/" in m), 0)
    addrs = probe_addrs(maddrs)
    name = "reachability"
    if not addrs:
        return Check(name, WARN, "no address another host could dial (loopback only)",
                     "listen on 0.0.0.0 (the default) or announce a LAN or public IP")
    ids = list(dict.fromkeys(peer_id_of(m) for m in initial_peers if "/p2p/" in m))
    relay = f"{run_id}::gasloc.relay.v{PROTOCOL_VERSION}"
    answers = [a for a in await asyncio.gather(*(ask_probe(p2p, relay, i, addrs, timeout_s) for i in ids))
               if a is not None]
    verdict = probe_verdict(answers)
    shown = ", ".join(f"{h}:{p}" for h, p in addrs)
    if verdict is None:
        return Check(name, SKIP, f"no initial peer answers reachability probes for run {run_id!r} (a plain hivemind "
                     "node, or another --run-id)", "give a gasloc bootstrap or peer of your run to find out")
    if verdict:
        return Check(name, OK, f"reachable: {sum(answers)}/{len(answers)} initial peer(s) dialled {shown} back; the "
                     "peer will run as public (others call it directly)")
    return Check(name, WARN, f"behind NAT: {len(answers)} initial peer(s) could not dial {shown}; the peer will run "
                 "with reachability private: it calls public peers, attaches to a forwarder (bootstrap or public "
                 "peer) and pairs with other NATed peers through it", "nothing is needed to train; to be dialled "
                 f"directly (no forwarder in the way) forward TCP port {port or '<P>'} on your router to this host "
                 f"and pass --port {port or '<P>'} --announce-maddrs /ip4/<your public IP>/tcp/{port or '<P>'}")


async def _network(initial_peers: list[str], announce_maddrs: list[str], public: bool, timeout_s: float,
                   max_skew_s: float, port: int = 0, run_id: str = "gasloc") -> list[Check]:
    from hivemind.p2p import P2P

    t0 = time.monotonic()
    try:
        # every interface and port 0: the addresses it reports are what a peer here would announce
        # no UPnP: a diagnostic should not open ports on the router
        # on the peer's port where given (free: check_port ran first), so the reachability probe tests the
        # router's forward of that very port. The time limit is P2P.create's own startup_timeout, not a
        # wait_for around it: cancelled from outside, create leaves the p2pd it spawned running (and its control
        # socket in /tmp); on its own timeout it shuts that daemon down before it raises
        p2p = await P2P.create(host_maddrs=[f"/ip4/0.0.0.0/tcp/{port}"], nat_port_map=False,
                               announce_maddrs=announce_maddrs or None, startup_timeout=timeout_s)
    except Exception as e:
        return [Check("p2pd", FAIL, f"p2pd did not start: {str(e).splitlines()[0][:160] if str(e) else type(e)}",
                      "reinstall hivemind (pip install --force-reinstall hivemind==1.1.12: p2pd ships in the wheel) "
                      "and check that /tmp is writable (its control sockets live there)")]
    out = [Check("p2pd", OK, f"started in {time.monotonic() - t0:.1f} s")]
    try:
        visible = [str(m) for m in await p2p.get_visible_maddrs()]
        out.append(check_announce(visible, public, given=bool(announce_maddrs)))
        if not initial_peers:
            out.append(Check("initial peers", SKIP, "none given: this peer would start a new swarm"))
            out.append(Check("clock skew", SKIP, "no peer to compare with (give --initial-peers)"))
        for maddr in initial_peers:
            out += await _ping(p2p, maddr, timeout_s, max_skew_s)
        if initial_peers:
            out.append(await _reachability(p2p, initial_peers, announce_maddrs or visible, run_id, timeout_s))
    finally:
        await p2p.shutdown()
    return out


def check_announce(visible: list[str], public: bool, given: bool) -> Check:
    scopes = {m: address_scope(m) for m in visible}
    reachable = [m for m, s in scopes.items() if s in ("public", "dns")]
    shown = ", ".join(sorted({m.split("/p2p/")[0] for m in visible})) or "(none)"
    if reachable:
        return Check("announced address", OK, f"public: {shown}")
    if public:
        return Check("announced address", FAIL, f"only loopback/private addresses would be announced: {shown}",
                     "peers on the internet cannot dial these: forward a TCP port on your router (or open it in "
                     "the cloud firewall) and pass --port <P> --announce-maddrs /ip4/<your public IP>/tcp/<P>")
    if all(s == "loopback" for s in scopes.values()):
        return Check("announced address", WARN, f"loopback only: {shown}",
                     "other machines cannot dial this peer: listen on 0.0.0.0 (the default) or announce a LAN IP")
    return Check("announced address", OK, f"private swarm (LAN/loopback): {shown}"
                 + ("" if given else "; add --public to check for an internet swarm"))


def network_checks(initial_peers: list[str], announce_maddrs: list[str], public: bool, timeout_s: float,
                   max_skew_s: float, port: int = 0, run_id: str = "gasloc") -> list[Check]:
    return asyncio.run(_network(initial_peers, announce_maddrs, public, timeout_s, max_skew_s, port, run_id))
