"""`gasloc bootstrap`: a plain hivemind DHT node with a stable identity, for peers to dial first.

Peers depend on nothing this node adds: it is a stock DHT node (a stock `hivemind.DHT` can take its place) that
also validates the run's records (signatures, schema) so it stores no garbage, and logs the run's swarm size.

Lifecycle: lock identity -> start DHT -> print maddrs (log, file, READY line) -> log the swarm size every
log_interval_s until SIGINT/SIGTERM -> shut the DHT down (p2pd and its sockets with it) -> exit 0.
"""
from __future__ import annotations

import fcntl
import logging
import os
import signal
import threading
from pathlib import Path

from gasloc.bootstrap.config import BootstrapConfig
from gasloc.runtime.lifecycle import shutdown_step
from gasloc.runtime.maddrs import port_of
from gasloc.runtime.procs import StopSignals, emit_ready

log = logging.getLogger(__name__)

EXIT_OK, EXIT_FAILED = 0, 1


class BootstrapError(RuntimeError):
    """A failure the operator can fix; the message is one line that says how."""


def start_hint(error: str, listen_maddrs: list[str]) -> str:
    """What to check when p2pd did not start, from its own words: p2pd exits when none of the initial peers
    answers, and that is not cured by looking at the listen addresses (the hint once said only that)."""
    if "failed to connect to bootstrap peers" in error:
        return ("none of --initial-peers answered: are those nodes running and reachable from here (gasloc doctor "
                "--initial-peers ADDR tries one), and do they use the same --swarm-key (a private swarm ignores "
                "nodes without it)?")
    port = next((p for proto, p in filter(None, map(port_of, listen_maddrs)) if proto == "tcp"), None)
    listen = "check --host-maddrs and that the port is free" + (f" (gasloc doctor --port {port})" if port else "")
    if "listen" in error or "bind" in error or "address already in use" in error:
        return listen
    return listen + ", and that --initial-peers are running and reachable"


def lock_identity(path: Path) -> int:
    """Create the key file if missing, then hold an exclusive lock on it for the life of this process.

    hivemind refuses a taken identity only when the node has initial peers to ask (check_if_identity_free); a
    bootstrap usually has none, so two nodes on one host sharing a key file are caught here instead."""
    from gasloc.runtime.identity import write_identity_file

    path = path.expanduser()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            write_identity_file(path)  # Ed25519, mode 0400, as a peer's (an RSA file made before still works)
            log.info("identity_created path=%s", path)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise BootstrapError(f"cannot create or read identity file {path}: {e.strerror}; pass --identity-path "
                             f"with a writable location") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise BootstrapError(f"identity {path} is already in use by another running node on this host; stop it, "
                             f"or give this one its own key with --identity-path") from None
    return fd


def write_maddrs_file(path: Path, peer_id: str, maddrs: list[str]) -> None:
    """One multiaddr per line, written to a temp file and renamed, so a reader never sees half a file."""
    path = path.expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(f"# gasloc bootstrap {peer_id}\n" + "".join(m + "\n" for m in maddrs))
    os.replace(tmp, path)


async def _routing_table_size(_dht, node) -> int:
    # runs inside the DHT process (DHT.run_coroutine): how many DHT nodes this one knows
    return len(node.protocol.routing_table.uid_to_peer_id)


def swarm_size(relay: _Relay, timeout_s: float) -> dict[str, int]:
    """The swarm as one probe of the run's bucket keys shows it (the same records peers find each other by):
    the size estimate, the records the probe saw by state, and how many DHT nodes this one knows."""
    reader = relay.reader
    seen = relay.aio.run(reader.probe(), timeout_s)
    if seen is None:
        raise TimeoutError
    # peers: the estimate (exact while the swarm fits one bucket); the states count the records sampled
    out = {"peers": round(reader.estimate.value), "max_round": max((r.round for r in seen.values()), default=0)}
    for r in seen.values():
        out[r.state] = out.get(r.state, 0) + 1
    out.update(buckets=1 << reader.level, sampled=len(seen))
    out["dht_nodes"] = relay.dht.run_coroutine(_routing_table_size, return_future=True).result(timeout=timeout_s)
    return out


class _Relay:
    """The bootstrap's share of NAT traversal (peer/swarm/forward.py): it answers reachability probes and, with
    `forwarding`, forwards streams to peers behind NAT that attach to it. A caller is a member when its record is
    in its bucket (one DHT get; a hit is remembered until the record's expiration)."""

    def __init__(self, dht, cfg: BootstrapConfig):
        from gasloc.peer.swarm.forward import RelayService, RoutedP2P
        from gasloc.peer.swarm.membership import BucketReader
        from gasloc.runtime.aio import LoopThread

        self.dht, self.run_id = dht, cfg.run_id
        self.reader = BucketReader(dht, run_id=cfg.run_id, request_timeout_s=5.0)
        self.members: dict = {}
        self.aio = LoopThread("bootstrap-relay")
        self.p2p = self.aio.run(dht.replicate_p2p(), cfg.startup_timeout_s)
        routed = RoutedP2P(self.p2p, cfg.run_id, lambda peer: None)
        self.service = RelayService(routed, is_member=self.is_member,
                                    volunteer=cfg.forwarding, max_circuits=cfg.forward_max_circuits,
                                    max_attached=cfg.forward_max_attached,
                                    circuit_timeout_s=cfg.forward_circuit_timeout_s)
        self.aio.run(self.service.start(), cfg.startup_timeout_s)
        self.aio.run(self.reader.probe(), cfg.startup_timeout_s)   # our level, so that `find` looks in one bucket

    async def is_member(self, peer_id) -> bool:
        pid = str(peer_id)
        self.members = self.reader.prune(self.members)
        if pid not in self.members:
            rec = await self.reader.find(pid)
            if rec is not None:
                self.members[pid] = rec
        return pid in self.members

    def stop(self) -> None:
        self.aio.run(self.service.stop(), 10)
        self.aio.run(self.p2p.shutdown(), 10)
        self.aio.stop()


def _start_relay(dht, cfg: BootstrapConfig) -> _Relay:
    relay = _Relay(dht, cfg)
    log.info("relay forwarding=%s max_circuits=%d max_attached=%d", cfg.forwarding, cfg.forward_max_circuits,
             cfg.forward_max_attached)
    return relay


def run(cfg: BootstrapConfig) -> int:
    stop = threading.Event()
    signals = StopSignals()

    def on_signal(signum, _frame):
        kind = signals.classify()
        if kind == "force":  # a second Ctrl+C: the operator does not want to wait for a clean shutdown
            log.warning("second_signal signal=%s exiting_now", signal.Signals(signum).name)
            os._exit(EXIT_FAILED)  # the DHT child dies with us (PR_SET_PDEATHSIG)
        if kind == "first":
            log.info("signal=%s shutting_down", signal.Signals(signum).name)
            stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    lock_fd = lock_identity(Path(cfg.identity_path))
    from hivemind.p2p import P2PDaemonError

    from gasloc.peer.swarm.membership import make_validators
    from gasloc.runtime.safeproc import SafeDHT

    _, validators = make_validators(cfg.run_id)
    extra = {}
    if cfg.key_path is not None:
        from gasloc.peer.swarm.private import SwarmKeyAuthorizer
        from gasloc.peer.swarm.swarmkey import load_swarm_key
        from gasloc.protocol.auth import SwarmKeyError
        try:
            extra["authorizer"] = SwarmKeyAuthorizer(load_swarm_key(cfg.key_path))
        except SwarmKeyError as e:
            os.close(lock_fd)
            raise BootstrapError(str(e)) from None
        log.info("private swarm: DHT requests must carry the swarm key of %s", cfg.key_path)
    try:
        dht = SafeDHT(
            initial_peers=cfg.initial_peers or None, start=True, record_validators=validators,
            host_maddrs=cfg.listen_maddrs, announce_maddrs=cfg.announce_maddrs or None,
            identity_path=str(Path(cfg.identity_path).expanduser()), startup_timeout=cfg.startup_timeout_s, **extra)
    except P2PDaemonError as e:
        if "already taken" in str(e):
            raise BootstrapError(f"identity {cfg.identity_path} is already used by a running node of this swarm; "
                                 f"give this node its own key with --identity-path") from None
        raise BootstrapError(f"p2pd failed to start: {e}; {start_hint(str(e), cfg.listen_maddrs)}") from None
    relay = None
    try:
        peer_id = str(dht.peer_id)
        maddrs = [str(m) for m in dht.get_visible_maddrs()]
        for m in maddrs:
            log.info("listening maddr=%s", m)
        if cfg.maddrs_file is not None:
            write_maddrs_file(cfg.maddrs_file, peer_id, maddrs)
            log.info("maddrs_file=%s", cfg.maddrs_file)
        relay = _start_relay(dht, cfg)
        emit_ready("bootstrap", peer_id, maddrs)
        while not stop.is_set():
            try:
                size = swarm_size(relay, cfg.request_timeout_s)
                log.info("swarm run_id=%s %s", cfg.run_id, " ".join(f"{k}={v}" for k, v in size.items()))
            except TimeoutError:
                log.warning("swarm_size_timeout run_id=%s timeout_s=%.1f", cfg.run_id, cfg.request_timeout_s)
            stop.wait(cfg.log_interval_s)
    finally:
        if relay is not None:
            shutdown_step("relay.stop", relay.stop)
        dht.shutdown()
        dht.join(5)
        # no remove_own_shm() here: the swarm-size listings' shared-memory tensors are still alive, and torch aborts
        # the process (SIGABRT, exit -6, seen in bench/soak.py runs) when their destructor finds the file unlinked;
        # torch unlinks them itself as the interpreter exits
        os.close(lock_fd)
    log.info("stopped peer_id=%s", peer_id)
    return EXIT_OK
