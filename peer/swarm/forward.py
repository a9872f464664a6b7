"""Peers behind NAT: the relay service every peer runs, the attachments a NATed peer keeps, and the p2p wrapper that
sends a call to a NATed peer through one of its forwarders. The rules (who calls whom) are in protocol/reach.py.

    caller A --stream--> forwarder R --stream over B's own connection--> B's "forwarded" handler -> B's handler
                          (copies bytes both ways, counts them)

A NATed peer B attaches to up to `attach_forwarders` public peers that volunteer (`network.forwarding`): one stream
per forwarder that stays open, so the connection B dialled stays up and R knows B is there. R forwards a stream to
B only while B is attached, at most `forward_max_circuits` at a time. B trusts the origin a forwarder names as far
as it trusts the forwarder: only forwarders B attached to itself may hand it streams, and the origin must still be
a live member for the exchange to accept it. The probe (kind "probe") answers "can you open a TCP connection to
these addresses of mine?", so a peer learns at start whether others can dial it (as Petals does).

Every coroutine runs on the peer's event loop. Timeouts are `asyncio.timeout` blocks, not `asyncio.wait_for`: these
tasks are cancelled from outside (detach_all, drop_attached, stop), and Python 3.11's wait_for drops a cancel that
arrives after the awaited call finished but before the task resumed; an attachment cancelled in that gap of its
handshake went on holding its stream (tests/unit/test_forward_cancel.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import ipaddress
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from hivemind.p2p import PeerID

from gasloc.peer.transport.channel import STREAM_ERRORS
from gasloc.protocol.codes import Code
from gasloc.protocol.messages import PROTOCOL_VERSION
from gasloc.protocol.reach import MAX_PROBE_ADDRS, MAX_VIA, ForwardedHello, RelayReply, RelayRequest
from gasloc.protocol.wire import LENGTH_PREFIX_BYTES, WireError, decode_header, encode_header, parse_length

log = logging.getLogger(__name__)

MAX_RELAY_HEADER_BYTES = 4096
HANDSHAKE_TIMEOUT_S = 3.0
PUMP_CHUNK = 1 << 16
ATTACH_RETRY_S = 10.0


@dataclass(frozen=True)
class ForwardedInfo:
    """What a handler sees of a forwarded stream: the origin's peer id, as the forwarder named it."""
    peer_id: PeerID
    forwarder: str


async def read_frame(reader: asyncio.StreamReader, cls):
    n = parse_length(await reader.readexactly(LENGTH_PREFIX_BYTES), MAX_RELAY_HEADER_BYTES)
    return decode_header(await reader.readexactly(n), cls)


async def _send(writer: asyncio.StreamWriter, header) -> None:
    writer.write(encode_header(header))
    await writer.drain()


def _reply(code: Code, message: str = "", reachable: tuple[bool, ...] = ()) -> RelayReply:
    return RelayReply(protocol_version=PROTOCOL_VERSION, code=int(code), message=message[:500], reachable=reachable)


def probe_addrs(maddrs: list[str]) -> list[tuple[str, int]]:
    """(ip, port) of our TCP multiaddrs that another host could dial: not loopback, unspecified or link-local, and
    not a relay circuit (`.../p2p/<relay>/p2p-circuit`: its ip and port are the relay's, which a prober reaches
    whether or not it can reach us - a NATed peer holding a reservation would read itself reachable)."""
    out = []
    for m in maddrs:
        parts = m.split("/")
        if "p2p-circuit" in parts:
            continue
        if len(parts) >= 5 and parts[1] == "ip4" and parts[3] == "tcp" and parts[4].isdigit():
            ip = ipaddress.ip_address(parts[2])
            if not (ip.is_loopback or ip.is_unspecified or ip.is_link_local) and (parts[2], int(parts[4])) not in out:
                out.append((parts[2], int(parts[4])))
    return out[:MAX_PROBE_ADDRS]


def relay_handler_name(namespace: str) -> str:
    """The stream handler of a run's relay service (probes, attachments, forward requests)."""
    return f"{namespace}::gasloc.relay.v{PROTOCOL_VERSION}"


class RoutedP2P:
    """hivemind's P2P with calls to NATed peers sent through a forwarder and forwarded streams dispatched to our own
    handlers. `via_of(peer)` is None for a direct call, else the forwarders to try (peer ids). Everything else is
    the wrapped P2P's."""

    def __init__(self, p2p, namespace: str, via_of: Callable[[str], list[str] | None]):
        self._p2p, self.via_of = p2p, via_of
        self.relay_name = relay_handler_name(namespace)
        self.forwarded_name = f"{namespace}::gasloc.forwarded.v{PROTOCOL_VERSION}"
        self._local: dict[str, Callable] = {}
        self.path: dict[str, str] = {}     # peer -> "direct" or "forwarded:<forwarder>" of our last stream with it
        self.accept_forwarded_from: Callable[[str], bool] = lambda forwarder: False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._p2p, name)

    async def add_binary_stream_handler(self, name: str, handler: Callable) -> None:
        async def direct(info, reader, writer):
            self.path[str(info.peer_id)] = "direct"
            await handler(info, reader, writer)
        self._local[name] = handler
        await self._p2p.add_binary_stream_handler(name, direct)

    async def remove_binary_stream_handler(self, name: str) -> None:
        self._local.pop(name, None)
        await self._p2p.remove_binary_stream_handler(name)

    async def call_binary_stream_handler(self, peer_id: PeerID, handler: str):
        peer = str(peer_id)
        via = self.via_of(peer)
        if via is None:
            self.path[peer] = "direct"
            return await self._p2p.call_binary_stream_handler(peer_id, handler)
        last: Exception = ConnectionError(f"{peer} is behind NAT and attached to no forwarder")
        for fwd in random.sample(via, len(via)):
            try:
                info, reader, writer = await self._p2p.call_binary_stream_handler(PeerID.from_base58(fwd),
                                                                                  self.relay_name)
                await _send(writer, RelayRequest(kind="forward", target=peer, handler=handler))
                async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
                    reply = await read_frame(reader, RelayReply)
            except (TimeoutError, WireError, *STREAM_ERRORS) as e:
                last = ConnectionError(f"forwarder {fwd}: {type(e).__name__}: {e}")
                continue
            code = Code.parse(reply.code)
            if code == Code.OK:
                self.path[peer] = f"forwarded:{fwd}"
                return info, reader, writer
            writer.close()
            last = ConnectionError(f"forwarder {fwd} refused: {code.name} {reply.message}")
        raise last

    async def dispatch_forwarded(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The handler of streams a forwarder opens to us: check who, read the hello, hand over to our handler."""
        forwarder = str(info.peer_id)
        try:
            if not self.accept_forwarded_from(forwarder):
                raise WireError(Code.NOT_MEMBER, f"{forwarder} is not a forwarder we attached to")
            async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
                hello = await read_frame(reader, ForwardedHello)
            handler = self._local.get(hello.handler)
            if handler is None or hello.handler == self.relay_name:
                raise WireError(Code.BAD_HEADER, f"no handler {hello.handler!r} here")
            origin = PeerID.from_base58(hello.origin)
        except (TimeoutError, WireError, ValueError, *STREAM_ERRORS) as e:
            log.info("forwarded_stream_refused forwarder=%s detail=%s", forwarder, e)
            writer.close()
            return
        self.path[hello.origin] = f"forwarded:{forwarder}"
        await handler(ForwardedInfo(origin, forwarder), reader, writer)


class RelayService:
    """The relay handler (attach / forward / probe) and, for a NATed peer, the attachments it keeps.

    volunteer: we forward for others and accept attachments (public peers with network.forwarding); every peer
    answers probes. Counters for metrics: forwarded_bytes (both directions), forwarded_circuits."""

    def __init__(self, routed: RoutedP2P, *, is_member: Callable[[PeerID], bool | Awaitable[bool]], volunteer: bool,
                 max_circuits: int, max_attached: int, circuit_timeout_s: float,
                 on_detached: Callable[[], None] = lambda: None):
        self.routed, self.is_member = routed, is_member
        self.on_detached = on_detached     # an attachment ended (refused, failed or lost): `via` just shrank
        self.volunteer, self.max_circuits, self.max_attached = volunteer, max_circuits, max_attached
        self.circuit_timeout_s = circuit_timeout_s
        self.attached_peers: set[str] = set()        # as a forwarder: NATed peers attached to us
        self._holds: dict[str, asyncio.Task] = {}    # ... and the handler task holding each one's stream
        self.attachments: dict[str, asyncio.Task] = {}   # as a NATed peer: forwarder -> the task holding it
        self.circuits = 0
        self.forwarded_bytes = 0
        self.forwarded_circuits = 0
        self._tasks: set[asyncio.Task] = set()
        self._retry_at: dict[str, float] = {}
        routed.accept_forwarded_from = lambda fwd: fwd in self.attachments

    async def start(self) -> None:
        await self.routed._p2p.add_binary_stream_handler(self.routed.relay_name, self._handle)
        await self.routed._p2p.add_binary_stream_handler(self.routed.forwarded_name, self.routed.dispatch_forwarded)

    async def stop(self) -> None:
        for t in [*self.attachments.values(), *self._tasks]:
            t.cancel()
        for name in (self.routed.relay_name, self.routed.forwarded_name):
            with contextlib.suppress(TimeoutError, KeyError, *STREAM_ERRORS):
                async with asyncio.timeout(5.0):
                    await self.routed._p2p.remove_binary_stream_handler(name)

    @property
    def via(self) -> list[str]:
        return sorted(f for f, t in self.attachments.items() if not t.done())[:MAX_VIA]

    # ------------------------------------------------------------------ the relay handler
    async def _handle(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        caller = str(info.peer_id)
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            try:
                async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
                    req = await read_frame(reader, RelayRequest)
            except WireError as e:
                return await _send(writer, _reply(e.code, str(e)))
            if req.kind == "probe":
                return await _send(writer, _reply(Code.OK, reachable=await self._probe(req.addrs)))
            if not self.volunteer:
                return await _send(writer, _reply(Code.NOT_FORWARDING, "this peer does not forward"))
            if not await self._member(info.peer_id):
                return await _send(writer, _reply(Code.NOT_MEMBER, "you are not a live member of this run"))
            if req.kind == "attach":
                await self._hold(caller, reader, writer)
            else:
                await self._forward(caller, req, reader, writer)
        except (TimeoutError, WireError, *STREAM_ERRORS) as e:
            log.debug("relay caller=%s ended=%s: %s", caller, type(e).__name__, e)
        except asyncio.CancelledError:
            pass  # stop(): the top of a task owned by asyncio's unix server (see Exchanger._handle)
        finally:
            self._tasks.discard(task)
            writer.close()

    async def _member(self, peer_id: PeerID) -> bool:
        """`is_member` may wait for a fresh listing (a joiner calls right after its first announcement, before our
        next periodic listing names it): it gets until shortly before the caller's handshake times out."""
        got = self.is_member(peer_id)
        if inspect.isawaitable(got):
            try:
                async with asyncio.timeout(HANDSHAKE_TIMEOUT_S - 0.5):
                    got = await got
            except TimeoutError:
                return False
        return bool(got)

    async def _probe(self, addrs) -> tuple[bool, ...]:
        """TCP connect only (no byte sent), 2 s each, to at most MAX_PROBE_ADDRS addresses, none of them ours."""
        async def one(host: str, port: int) -> bool:
            try:
                ip = ipaddress.ip_address(host)
            except ValueError:
                return False
            if ip.is_loopback or ip.is_unspecified or ip.is_multicast or not 0 < port < 65536:
                return False
            try:
                async with asyncio.timeout(2.0):
                    _, w = await asyncio.open_connection(host, port)
            except (TimeoutError, OSError):
                return False
            w.close()
            return True
        return tuple(await asyncio.gather(*(one(h, p) for h, p in addrs)))

    async def _hold(self, caller: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if caller not in self.attached_peers and len(self.attached_peers) >= self.max_attached:
            return await _send(writer, _reply(Code.FORWARD_FULL, f"{self.max_attached} peers attached already"))
        self.attached_peers.add(caller)
        self._holds[caller] = asyncio.current_task()
        log.info("relay attached peer=%s attached=%d", caller, len(self.attached_peers))
        try:
            await _send(writer, _reply(Code.OK))
            while await reader.read(1024):   # the peer sends nothing; EOF or reset means it left
                pass
        finally:
            self.attached_peers.discard(caller)
            if self._holds.get(caller) is asyncio.current_task():
                del self._holds[caller]
            log.info("relay detached peer=%s attached=%d", caller, len(self.attached_peers))

    async def _forward(self, caller: str, req: RelayRequest, reader, writer) -> None:
        if req.target not in self.attached_peers:
            return await _send(writer, _reply(Code.NOT_ATTACHED, f"{req.target} is not attached to this forwarder"))
        if self.circuits >= self.max_circuits:
            return await _send(writer, _reply(Code.FORWARD_FULL, f"{self.max_circuits} circuits in use"))
        self.circuits += 1
        out_writer = None
        try:
            async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
                _, out_reader, out_writer = await self.routed._p2p.call_binary_stream_handler(
                    PeerID.from_base58(req.target), self.routed.forwarded_name)
            await _send(out_writer, ForwardedHello(origin=caller, handler=req.handler))
            await _send(writer, _reply(Code.OK))
            self.forwarded_circuits += 1
            async with asyncio.timeout(self.circuit_timeout_s):
                await asyncio.gather(self._pump(reader, out_writer), self._pump(out_reader, writer))
        finally:
            self.circuits -= 1
            if out_writer is not None:
                out_writer.close()

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        while chunk := await src.read(PUMP_CHUNK):
            dst.write(chunk)
            self.forwarded_bytes += len(chunk)
            await dst.drain()
        with contextlib.suppress(*STREAM_ERRORS):
            if dst.can_write_eof():
                dst.write_eof()

    def drop_attached(self) -> None:
        """We just learnt we are behind NAT: end the attachments others hold to us (their callers could no longer
        dial us), so that they attach elsewhere. Their side sees the stream end (`attach ... lost`)."""
        for task in list(self._holds.values()):
            task.cancel()

    # ------------------------------------------------------------------ as a NATed peer
    def detach_all(self) -> None:
        """We just learnt we are reachable: close our attachments (each one's end calls on_detached)."""
        for task in self.attachments.values():
            task.cancel()
        self.attachments.clear()
        self._retry_at.clear()

    def keep_attached(self, candidates: list[str], want: int) -> None:
        """Attach to forwarders among `candidates` (live, direct, volunteering peers) until `want` are held."""
        now = asyncio.get_running_loop().time()
        for fwd, t in list(self.attachments.items()):
            if t.done():
                del self.attachments[fwd]
        for fwd in random.sample(candidates, len(candidates)):
            if len(self.attachments) >= want:
                break
            if fwd not in self.attachments and self._retry_at.get(fwd, 0.0) <= now:
                self.attachments[fwd] = task = asyncio.ensure_future(self._attach(fwd))
                # done: `via` no longer lists it, and our record should not either
                task.add_done_callback(lambda _: self.on_detached())

    async def _attach(self, fwd: str) -> None:
        """One attachment: open the stream, then hold it until the forwarder closes it (or stop())."""
        writer = None
        try:
            async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
                _, reader, writer = await self.routed._p2p.call_binary_stream_handler(
                    PeerID.from_base58(fwd), self.routed.relay_name)
            await _send(writer, RelayRequest(kind="attach"))
            async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
                reply = await read_frame(reader, RelayReply)
            if Code.parse(reply.code) != Code.OK:
                code = Code.parse(reply.code)
                log.info("attach forwarder=%s refused=%s %s", fwd, code.name, reply.message)
                # NOT_MEMBER: its listing does not have our fresh record yet (it lists every 1-2 s)
                self._later(fwd, 2.0 if code == Code.NOT_MEMBER else ATTACH_RETRY_S)
                return
            log.info("attach forwarder=%s ok", fwd)
            while await reader.read(1024):
                pass
            log.info("attach forwarder=%s lost", fwd)
        except (TimeoutError, WireError, *STREAM_ERRORS) as e:
            log.info("attach forwarder=%s failed=%s: %s", fwd, type(e).__name__, e)
            self._later(fwd, ATTACH_RETRY_S)
        finally:
            if writer is not None:
                writer.close()

    def _later(self, fwd: str, after_s: float) -> None:
        """A forwarder that refused or failed is tried again only `after_s` later (others meanwhile)."""
        self._retry_at[fwd] = asyncio.get_running_loop().time() + after_s
        if len(self._retry_at) > 4096:
            self._retry_at.pop(next(iter(self._retry_at)))


async def probe(p2p, relay_name: str, probers: list[str], addrs: list[tuple[str, int]], timeout_s: float
                ) -> list[bool]:
    """Ask each prober whether it can dial any of `addrs`; one answer per prober that replied in time."""
    answers = await asyncio.gather(*(ask_probe(p2p, relay_name, p, addrs, timeout_s) for p in probers))
    return [a for a in answers if a is not None]


async def ask_probe(p2p, relay_name: str, peer: str, addrs: list[tuple[str, int]], timeout_s: float) -> bool | None:
    """One prober's answer: could it open a TCP connection to any of `addrs`? None: it did not answer (not a gasloc
    node, or gone)."""
    writer = None
    try:
        async with asyncio.timeout(timeout_s):
            _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer), relay_name)
            await _send(writer, RelayRequest(kind="probe", addrs=tuple(addrs)))
            reply = await read_frame(reader, RelayReply)
        return Code.parse(reply.code) == Code.OK and any(reply.reachable)
    except (TimeoutError, WireError, ValueError, *STREAM_ERRORS) as e:
        log.info("probe prober=%s no_answer=%s: %s", peer, type(e).__name__, e)
        return None
    finally:
        if writer is not None:
            writer.close()
