"""Joining mid-run: a live peer serves a snapshot of its state; a joiner downloads it from the first donor that works.

Protocol on one raw stream: joiner -> StateRequest header; donor -> StateReply header (a Code; with OK the round,
metadata, specs, total_bytes and the sha256 of the payload), then the payload: every tensor in its own dtype, raw.
Tensors are the donor's parameters followed by `num_outer` outer-optimizer state tensors (the daemon puts
`"num_outer": k` in the metadata when it serves outer state; 0 or absent means parameters only).

The donor checks who before what: it reads the request header (capped at STATE_REQUEST_BYTES) and nothing else
before the caller is a proven member; at most `max_concurrent_requests` callers are handled at once (more are
closed unread); in a private swarm the request must carry the proof of the swarm key (NOT_AUTHORIZED), then the
joiner's own signed record it carries must pass `admit` (an older joiner without one is looked up in the DHT),
else NOT_MEMBER; the reply carries the donor's proof, without which the joiner takes nothing. A joiner that received a whole state is refused further ones (RATE_LIMITED) for
`min_request_interval_s`, so nobody can keep a donor snapshotting, hashing and sending its state.

The joiner validates before buffering (version, fingerprint, specs equal to what it expects, declared size within
the cap) and after (sha256, finite values). A donor that is busy, dies, sends garbage or sends slower than its
payload's deadline (`payload_deadline_s`: accept_timeout_s plus the payload's size at `min_rate_mbit`) is skipped
and the next one is tried; only a fully verified state is returned. The same deadline bounds a donor's serve.
"""
from __future__ import annotations

import asyncio
import hashlib
import inspect
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import torch
from hivemind.p2p import P2P, PeerID
from pydantic import BaseModel, ConfigDict, Field

from gasloc.peer.transport.channel import STREAM_ERRORS, Channel, read_header
from gasloc.peer.transport.exchange import SpecLike
from gasloc.peer.transport.tensor_io import byte_view, in_thread, is_finite, torch_dtype
from gasloc.protocol.auth import PROOF_HEX_CHARS, STATE_ANSWER, STATE_CALL, proof_ok, stream_proof
from gasloc.protocol.buckets import WIDEST_HINTS, PeerHint, from_wire, wire_hints
from gasloc.protocol.codes import Code
from gasloc.protocol.donors import check_metadata
from gasloc.protocol.messages import (
    PROTOCOL_VERSION,
    StateReply,
    StateRequest,
    TensorSpec,
    WireMember,
    payload_bytes,
)
from gasloc.protocol.wire import STATE_REQUEST_BYTES, WireError, check_state_reply, encode_header, header_cap

log = logging.getLogger(__name__)

BUSY_RETRY_S = 0.5  # pause before asking donors that answered BUSY again

State = tuple[dict[str, Any], Sequence[torch.Tensor]]
# a snapshot now, or (the daemon's) a coroutine that waits for the next round boundary; None: not ready, answer BUSY
GetState = Callable[[], "State | None | Awaitable[State | None]"]


class StateTransferConfig(BaseModel):
    """How a joiner downloads state, and how long a donor waits for a joiner's request."""
    model_config = ConfigDict(extra="forbid")

    per_donor_timeout_s: float | None = Field(None, gt=0, description="cap on one whole download from one donor "
                                              "(and on one serve); unset: each payload's own deadline "
                                              "(min_rate_mbit) is the only one")
    accept_timeout_s: float = Field(10.0, gt=0, description="how long to wait for a donor's reply header (the donor "
                                    "snapshots and checksums its state first)")
    min_rate_mbit: float = Field(2.0, gt=0, description="the slowest a state may travel, in Mbit/s: a payload gets "
                                 "accept_timeout_s plus its size at this rate, then the donor is skipped for the next "
                                 "(a donor sending to a slower joiner gives up alike); so a trickling donor holds a "
                                 "joiner no longer than an honest donor this slow would (the hetero bench's slow "
                                 "volunteers: 3 Mbit/s)")
    max_state_bytes: int | None = Field(None, gt=0, description="cap on a donor's declared payload; default: "
                                        "exactly what the expected specs imply")
    chunk_bytes: int = Field(1 << 20, ge=4096, le=64 << 20, description="bytes per write on the donor side")
    max_concurrent_requests: int = Field(4, ge=1, le=1024, description="joiners' requests handled at once by a "
                                         "donor (one is served, the others answered BUSY); more are closed unread")
    min_request_interval_s: float = Field(30.0, ge=0, description="a donor serves one joiner a whole state at "
                                          "most once per this many seconds, counted from the end of its last "
                                          "serve (RATE_LIMITED otherwise); 0: no limit")


def payload_time_s(cfg: StateTransferConfig, nbytes: int) -> float:
    """`nbytes` at the slowest rate we accept (min_rate_mbit)."""
    return nbytes * 8 / (cfg.min_rate_mbit * 1e6)


def payload_deadline_s(cfg: StateTransferConfig, nbytes: int) -> float:
    """How long a payload of `nbytes` may take on the wire, from the reply header on (both sides use it)."""
    return cfg.accept_timeout_s + payload_time_s(cfg, nbytes)


def handler_name(namespace: str) -> str:
    return f"{namespace}::gasloc.state.v{PROTOCOL_VERSION}"


def _payload_digest(tensors: Sequence[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(byte_view(t))      # hashlib releases the GIL on large buffers
    return h.hexdigest()


class StateServer:
    """Serves `get_state()` snapshots to joiners. One transfer at a time (a snapshot costs a model copy); a second
    concurrent joiner gets BUSY and tries another donor."""

    def __init__(self, p2p: P2P, get_state: GetState, fingerprint: str, namespace: str,
                 cfg: StateTransferConfig | None = None, *, is_member: Callable[[PeerID], Awaitable[bool]],
                 swarm_key: bytes | None = None, on_served: Callable[..., None] | None = None,
                 hints_out: Callable[[str], Sequence[PeerHint]] | None = None,
                 hints_in: Callable[..., None] | None = None,
                 admit: Callable[[PeerID, WireMember | None], Awaitable[bool]] | None = None):
        self.p2p, self.get_state, self.fingerprint = p2p, get_state, fingerprint
        self.on_served = on_served or (lambda **fields: None)  # one call per served download (metrics)
        self.cfg = cfg or StateTransferConfig()
        self.name = handler_name(namespace)
        self.is_member, self.swarm_key = is_member, swarm_key
        # membership given the joiner's inline record (None: an older joiner); by default `is_member`
        self.admit = admit or (lambda peer_id, member: is_member(peer_id))
        # peer exchange (protocol/buckets.py): a joiner learns of live peers from its donor's every answer
        self.hints_out = hints_out or (lambda joiner: ())
        self.hints_in = hints_in or (lambda joiner, hints, **seen: None)
        self._served_at: OrderedDict[str, float] = OrderedDict()   # joiner -> when it last got a whole state
        self.bytes_served = 0
        self._serving = False
        self._started = False
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(self.name, self._handle)
        self._started = True

    async def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        if self._started:
            self._started = False
            try:
                async with asyncio.timeout(5.0):
                    await self.p2p.remove_binary_stream_handler(self.name)
            except (TimeoutError, KeyError, *STREAM_ERRORS) as e:
                log.debug("remove_handler name=%s error=%s: %s", self.name, type(e).__name__, e)

    async def _reply(self, ch: Channel, code: Code, message: str, joiner: str | None = None) -> None:
        """An answer without state; with `joiner` (a member), it carries our hints too."""
        reply = StateReply(protocol_version=PROTOCOL_VERSION, code=int(code), message=message[:500],
                           fingerprint=self.fingerprint,
                           peers=() if joiner is None else wire_hints(self.hints_out(joiner)))
        await ch.write(encode_header(reply))
        await ch.discard_until_eof(timeout=1.0)

    async def _handle(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        ch = Channel.take_over(reader, writer)
        joiner = str(info.peer_id)
        if len(self._tasks) >= self.cfg.max_concurrent_requests:
            log.debug("state_serve joiner=%s refused=request_cap", joiner)
            ch.close()
            return
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            async with asyncio.timeout(self.cfg.per_donor_timeout_s):
                # who before what: the capped header only (it carries the joiner's signed record), then the key's
                # proof, then the caller's transport identity against that record
                try:
                    async with asyncio.timeout(self.cfg.accept_timeout_s):
                        request = await read_header(ch, StateRequest, STATE_REQUEST_BYTES)
                except WireError as e:
                    return await self._reply(ch, e.code, str(e))
                except asyncio.IncompleteReadError:
                    return await self._reply(ch, Code.BAD_HEADER, "the request header was cut short")
                me = self.p2p.peer_id.to_base58()
                if not proof_ok(self.swarm_key, request.auth, STATE_CALL, joiner, me):
                    return await self._reply(ch, Code.NOT_AUTHORIZED, "no valid proof of this swarm's key")
                async with asyncio.timeout(self.cfg.accept_timeout_s):
                    member = await self.admit(info.peer_id, request.member)
                if not member:
                    return await self._reply(ch, Code.NOT_MEMBER, "you are not a live member of this run")
                if request.fingerprint != self.fingerprint:
                    return await self._reply(ch, Code.BAD_FINGERPRINT, "fingerprint differs from the donor's")
                last = self._served_at.get(joiner)
                if last is not None and time.monotonic() - last < self.cfg.min_request_interval_s:
                    ago = time.monotonic() - last
                    return await self._reply(ch, Code.RATE_LIMITED, f"you got my whole state {ago:.0f} s ago; at "
                                             f"most one per {self.cfg.min_request_interval_s:.0f} s")
                self.hints_in(joiner, from_wire(request.peers))
                if self._serving:
                    return await self._reply(ch, Code.BUSY, "serving another joiner", joiner)
                self._serving = True
                try:
                    await self._serve(ch, joiner, me)
                finally:
                    self._serving = False
        except (TimeoutError, *STREAM_ERRORS) as e:
            log.info("state_serve joiner=%s outcome=failed detail=%s: %s", joiner, type(e).__name__, e)
        except asyncio.CancelledError:
            # stop() cancelled us; this task belongs to asyncio's unix server, whose done-callback logs a cancelled
            # handler as an error, so the cancellation ends here, at the top of the task
            log.debug("state_serve joiner=%s cancelled", joiner)
        finally:
            self._tasks.discard(task)
            ch.close()

    async def _serve(self, ch: Channel, joiner: str, me: str) -> None:
        t0 = time.monotonic()
        state = self.get_state()
        if inspect.isawaitable(state):
            state = await state
        if state is None:
            log.info("state_serve joiner=%s outcome=BUSY detail=no snapshot before the round boundary", joiner)
            return await self._reply(ch, Code.BUSY, "state snapshot is taken at our next round boundary; ask again",
                                     joiner)
        metadata, tensors = state
        tensors = [t.detach().contiguous() for t in tensors]
        digest = await in_thread(_payload_digest, tensors)
        specs = tuple(TensorSpec.of(t.shape, t.dtype) for t in tensors)
        reply = StateReply(protocol_version=PROTOCOL_VERSION, code=int(Code.OK), fingerprint=self.fingerprint,
                           round=int(metadata.get("round", 0)), num_outer=int(metadata.get("num_outer", 0)),
                           metadata=metadata, specs=specs, total_bytes=payload_bytes(specs), sha256=digest,
                           auth="" if self.swarm_key is None else stream_proof(self.swarm_key, STATE_ANSWER, joiner,
                                                                                  me),
                           peers=wire_hints(self.hints_out(joiner)))
        await ch.write(encode_header(reply))
        self._remember_served(joiner)     # while we serve it, the same joiner asking again is RATE_LIMITED
        # a joiner that reads slower than min_rate_mbit holds our one serving slot no longer than its payload's time
        deadline_s = payload_deadline_s(self.cfg, reply.total_bytes)
        try:
            async with asyncio.timeout(deadline_s):
                for t in tensors:
                    await ch.write(byte_view(t), self.cfg.chunk_bytes)
                    self.bytes_served += t.numel() * t.element_size()
            # wait for the joiner's 1-byte verdict so that closing does not cut the tail of the payload; it hashes
            # and checks what it got first, far faster than the slowest rate it may arrive at
            async with asyncio.timeout(deadline_s):
                verdict = Code.parse((await ch.readexactly(1))[0])
        finally:
            # and again from the serve's end, whatever it was (a cut transfer also used us): a joiner that stops
            # reading, whose payload's deadline is longer than min_request_interval_s, could otherwise take the slot
            # back to back
            self._remember_served(joiner)
        seconds = time.monotonic() - t0
        log.info("state_serve joiner=%s outcome=%s mb=%.1f seconds=%.2f",
                 joiner, verdict.name, reply.total_bytes / 1e6, seconds)
        self.on_served(joiner=joiner, outcome=verdict.name, bytes=reply.total_bytes, seconds=seconds)

    def _remember_served(self, joiner: str) -> None:
        if len(self._served_at) >= 4096:             # bounded: forget the oldest joiner
            self._served_at.popitem(last=False)
        self._served_at.pop(joiner, None)
        self._served_at[joiner] = time.monotonic()


def _reply_cap(specs: list[TensorSpec]) -> int:
    """The longest state reply a donor of these tensors sends (its metadata is small), plus slack."""
    return header_cap(StateReply(protocol_version=PROTOCOL_VERSION, code=0, message="m" * 512, fingerprint="f" * 128,
                                 round=2**62, num_outer=2**62, metadata={"m" * 64: "m" * 512},
                                 specs=tuple(TensorSpec(shape=s.shape, dtype="bfloat16") for s in specs),
                                 total_bytes=2**62, sha256="s" * 64, auth="a" * PROOF_HEX_CHARS, peers=WIDEST_HINTS))


async def _download_from(p2p: P2P, donor: PeerID, name: str, specs: list[TensorSpec],
                         outer_specs: list[TensorSpec] | None, fingerprint: str, cfg: StateTransferConfig,
                         swarm_key: bytes | None = None, hints_in: Callable[..., None] | None = None,
                         member: WireMember | None = None, round_caps: Mapping[str, int] | None = None,
                         listed_rounds: Mapping[str, int] | None = None
                         ) -> tuple[dict[str, Any], list[torch.Tensor]]:
    ch: Channel | None = None
    me, them = p2p.peer_id.to_base58(), donor.to_base58()
    try:
        async with asyncio.timeout(cfg.per_donor_timeout_s):
            async with asyncio.timeout(cfg.accept_timeout_s):
                _, reader, writer = await p2p.call_binary_stream_handler(donor, name)
                ch = Channel.take_over(reader, writer)
                await ch.write(encode_header(StateRequest(
                    protocol_version=PROTOCOL_VERSION, fingerprint=fingerprint,
                    auth="" if swarm_key is None else stream_proof(swarm_key, STATE_CALL, me, them), member=member)))
                reply = await read_header(ch, StateReply, _reply_cap(specs + (outer_specs or [])))
            if hints_in is not None and reply.code != int(Code.NOT_MEMBER):
                hints_in(them, from_wire(reply.peers))
            cap = cfg.max_state_bytes or payload_bytes(specs + (outer_specs or []))
            code, why = check_state_reply(reply, expected_specs=specs, outer_specs=outer_specs,
                                          fingerprint=fingerprint, max_bytes=cap)
            if code != Code.OK:
                raise WireError(code, why)
            if not proof_ok(swarm_key, reply.auth, STATE_ANSWER, me, them):
                raise WireError(Code.NOT_AUTHORIZED, "donor did not prove the swarm key")
            # the metadata is the donor's claim: checked before a byte of payload is read (protocol/donors.py)
            code, why = check_metadata(reply.metadata, reply_round=reply.round, num_outer=reply.num_outer,
                                       donor=them, max_round=None if round_caps is None else round_caps.get(them),
                                       listed_round=None if listed_rounds is None else listed_rounds.get(them))
            if code != Code.OK:
                raise WireError(code, why)
            # buffers sized from the validated specs, which equal ours: bounded by our own state size
            tensors = [torch.empty(s.shape, dtype=torch_dtype(s.dtype)) for s in reply.specs]
            deadline_s, t_payload = payload_deadline_s(cfg, reply.total_bytes), time.monotonic()
            try:
                async with asyncio.timeout(deadline_s):
                    for t in tensors:
                        await ch.readinto(byte_view(t))
            except TimeoutError:
                raise WireError(Code.TIMEOUT, f"the payload ({reply.total_bytes / 1e6:.1f} MB) took longer than "
                                f"{deadline_s:.1f} s (accept_timeout_s + its size at min_rate_mbit="
                                f"{cfg.min_rate_mbit:g}); {time.monotonic() - t_payload:.1f} s so far") from None
            digest = await in_thread(_payload_digest, tensors)
            verdict = Code.OK
            if digest != reply.sha256:
                verdict, why = Code.BAD_CHECKSUM, "payload sha256 differs from the declared one"
            elif not all(await in_thread(lambda: [is_finite(t) for t in tensors])):
                verdict, why = Code.NOT_FINITE, "state contains NaN or Inf"
            await ch.write(bytes([verdict]))
            if verdict != Code.OK:
                raise WireError(verdict, why)
            # what the header says, checked against the metadata above; the donor is whom the stream came from
            metadata = {**reply.metadata, "round": reply.round, "num_outer": reply.num_outer, "peer_id": them}
            return metadata, tensors
    finally:
        if ch is not None:
            ch.close()


class StateDownloadError(Exception):
    """No donor delivered a valid state; the message lists what each donor did."""


async def download_state(p2p: P2P, donors: Sequence[PeerID], specs: Sequence[SpecLike], fingerprint: str,
                         cfg: StateTransferConfig, namespace: str, *,
                         outer_specs: Sequence[SpecLike] | None = None, swarm_key: bytes | None = None,
                         hints_in: Callable[..., None] | None = None, member: WireMember | None = None,
                         round_caps: Mapping[str, int] | None = None, listed_rounds: Mapping[str, int] | None = None
                         ) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The state of the first donor (in the given order) that delivers a verified one: (metadata, tensors).
    `round_caps`: donor peer id -> the most we believe of its round; a donor whose reply claims more is refused
    (DISTRUSTED) before its payload is read. `listed_rounds`: donor peer id -> the round its record announces; a
    donor whose reply serves a state well behind that claim is refused the same way (protocol/donors.py
    record_overclaims).

    `tensors` are the parameters (matching `specs`) followed, when the donor served outer state and `outer_specs`
    is given, by the outer-state tensors; `metadata["num_outer"]` says how many. Raises StateDownloadError when
    every donor failed.
    """
    want = [s if isinstance(s, TensorSpec) else TensorSpec.of(*s) for s in specs]
    want_outer = None if outer_specs is None else [s if isinstance(s, TensorSpec) else TensorSpec.of(*s)
                                                   for s in outer_specs]
    failures: list[str] = []
    pending = list(donors)
    while pending:
        busy = await _try_donors(p2p, pending, namespace, want, want_outer, fingerprint, cfg, failures, swarm_key,
                                 hints_in, member, round_caps, listed_rounds)
        if isinstance(busy, tuple):
            return busy
        # a BUSY donor serves another joiner or takes our snapshot at its next round boundary: ask it again (the
        # caller's join budget bounds the whole download: peer/swarm/joining.py)
        pending = busy
        if pending:
            await asyncio.sleep(BUSY_RETRY_S)
    raise StateDownloadError("no donor delivered a valid state: " + ("; ".join(failures) or "no donors given"))


async def _try_donors(p2p: P2P, donors: Sequence[PeerID], namespace: str, want: list[TensorSpec],
                      want_outer: list[TensorSpec] | None, fingerprint: str, cfg: StateTransferConfig,
                      failures: list[str], swarm_key: bytes | None, hints_in: Callable[..., None] | None = None,
                      member: WireMember | None = None, round_caps: Mapping[str, int] | None = None,
                      listed_rounds: Mapping[str, int] | None = None
                      ) -> tuple[dict[str, Any], list[torch.Tensor]] | list[PeerID]:
    """One pass over the donors: the first verified state, else the donors that answered BUSY."""
    busy = []
    for donor in donors:
        t0 = time.monotonic()
        try:
            metadata, tensors = await _download_from(p2p, donor, handler_name(namespace), want, want_outer,
                                                     fingerprint, cfg, swarm_key, hints_in, member, round_caps,
                                                     listed_rounds)
        except (TimeoutError, WireError, *STREAM_ERRORS) as e:
            code = e.code.name if isinstance(e, WireError) else ("TIMEOUT" if isinstance(e, TimeoutError) else
                                                                   "FAILED")
            detail = f"{type(e).__name__}: {e}"
            log.info("state_download donor=%s outcome=%s seconds=%.2f detail=%r",
                     donor, code, time.monotonic() - t0, detail)
            if isinstance(e, WireError) and e.code == Code.BUSY:
                busy.append(donor)
            else:
                failures.append(f"{donor}: {code} ({detail})")
            continue
        except Exception as e:  # noqa: BLE001 - whatever a hostile donor's bytes provoke ends that download only
            detail = f"{type(e).__name__}: {e}"
            log.warning("state_download donor=%s outcome=INTERNAL detail=%r", donor, detail)
            failures.append(f"{donor}: INTERNAL ({detail})")
            continue
        log.info("state_download donor=%s outcome=ok round=%s seconds=%.2f",
                 donor, metadata.get('round'), time.monotonic() - t0)
        return metadata, tensors
    return busy
