"""The pairwise, full-duplex tensor exchange of one gossip round, over a hivemind p2pd raw binary stream.

Protocol (initiator I, responder R), on a control stream plus n-1 extra streams ("lanes", see lanes.py):

    I -> R  ExchangeRequest header (fingerprint, codec, specs, total_bytes, n; a modulo codec: a probe seed and
            I's values at those positions); nothing else until R answers
    R -> I  ExchangeReply header: a Code; with OK, R's own codec, specs, a token and a seed (a seeded codec's
            blocks or dither; a modulo codec: R's values at I's probe positions, from which both size the step)
                                                                                            (I waits at most accept_timeout_s)
    I -> R  n-1 lane streams, each presenting the token
    I <-> R both payloads at once, raw, split over the n lanes, straight into preallocated tensors; a dense
            codec of whole-byte codes decoded as they land (peer/transport/landing.py); a modulo codec, encoded
            only now: each lane's share of a tensor sent as soon as it is encoded (`_pipelined`)
    I <-> R one verdict byte each on the control stream: OK, or why the partner's tensors were discarded

Failure semantics (what the daemon may rely on):
- An exchange is `ok` only if both payloads arrived whole, ours passed the partner's checks and theirs passed ours
  (the verdict bytes). Anything else returns tensors=None: a half-received partner state is never returned, and the
  offered tensors are never written to.
- Who before what: we read a caller's request header and nothing else before it is a proven member. The header
  may be at most our own header's size plus slack (`header_cap`); in a private swarm it must carry the proof of
  the swarm key bound to both peer ids (else NOT_AUTHORIZED, and an initiator sends nothing to a responder whose
  OK lacks its own proof); then the caller's signed record it carries (`member`, checked by `admit`; an older
  caller without one is looked up) must be its own and live, else NOT_MEMBER. None of these answers names
  other peers. At most `max_concurrent_handlers` callers are served at once; more are closed
  on unread.
- Everything a partner declares is validated before a byte of payload is buffered: version, fingerprint,
  codec, declared size <= max_message_bytes and = what the codec makes of our specs, tensor count, shapes and
  dtypes; values are checked finite after decoding. Receive buffers are sized from OUR specs and the codec, so
  memory is bounded by our own model size.
- Payloads are in each side's codec (protocol/codec.py; peer/transport/staging.py owns the buffers); an ok result
  carries the partner's tensors decoded and our own as the partner decoded them (`own_wire`), which the daemon
  mixes against so that the pair's mean is kept exactly whatever the codecs.
- Every wait has a deadline: accept_timeout_s for the handshake, exchange_timeout_s for the whole exchange. A
  partner killed with kill -9 is seen at once (p2pd resets the stream); a silent one at the deadline.
- One exchange per offer: a responder accepts only while it has an unused offer and is not engaged, else BUSY.
  Two peers that call each other at the same moment both get BUSY (each is engaged as initiator); the daemon
  retries with another partner or after a random backoff.
- Remaining asymmetry (two generals): each side sends its verdict and then reads the partner's. If the stream dies
  after one verdict was delivered and before the other was, one side returns ok and the other failed. The window
  is one byte's flight time; the daemon treats a failed exchange as a solo round, so the swarm mean drifts slightly
  for one round and nothing is corrupted. `withdraw()` never opens this window: it cancels an incoming exchange
  only before our verdict is sent and waits for one that is past it. Do not cancel `exchange()` from outside (it
  has its own deadline): a cancellation after our verdict went out is the same asymmetric case.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import random
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal

import torch
from hivemind.p2p import P2P, PeerID
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gasloc.peer.transport.channel import STREAM_ERRORS, Channel, read_header
from gasloc.peer.transport.landing import Landing
from gasloc.peer.transport.lanes import LaneRegistry, Watermark, gather_or_cancel, move, open_lanes
from gasloc.peer.transport.staging import Staging
from gasloc.peer.transport.tensor_io import in_thread
from gasloc.protocol.auth import EXCHANGE_ANSWER, EXCHANGE_CALL, PROOF_HEX_CHARS, proof_ok, stream_proof
from gasloc.protocol.buckets import WIDEST_HINTS, PeerHint, from_wire, wire_hints
from gasloc.protocol.codec import (
    DEFAULT_CODEC,
    MAX_CODEC_CHARS,
    Codec,
    CodecError,
    check_name,
    exchange_mix_momentum,
    exchange_mix_weight,
    probe,
    probe_numel,
    probe_steps,
    probe_text,
    read_probe,
    sent_codec,
)
from gasloc.protocol.codec import parse as parse_codec
from gasloc.protocol.codes import Code
from gasloc.protocol.messages import (
    MAX_STREAMS,
    MAX_WIRE_MEMBERS,
    PROTOCOL_VERSION,
    WIDEST_MEMBER,
    WIDEST_MEMBERS,
    ExchangeReply,
    ExchangeRequest,
    TensorSpec,
    WireHint,
    WireMember,
    payload_bytes,
)
from gasloc.protocol.wire import WireError, check_reply, check_request, encode_header, header_cap, lane_count

log = logging.getLogger(__name__)

# a responder's BUSY reason when it has no unused offer: it paired or ended its search this round (the partner
# search takes that as "not coming"; a BUSY while engaged may still end in a free offer)
NO_FREE_OFFER = "no free offer"

SpecLike = TensorSpec | tuple[Sequence[int], Any]


class ExchangeConfig(BaseModel):
    """How one peer exchanges tensors with a partner."""
    model_config = ConfigDict(extra="forbid")

    exchange_timeout_s: float = Field(30.0, gt=0, description="deadline of a whole exchange, handshake included")
    accept_timeout_s: float = Field(2.0, gt=0, description="how long an initiator waits for accept/busy, and a "
                                    "responder for the request header")
    codec: str = Field(DEFAULT_CODEC, max_length=MAX_CODEC_CHARS, description="wire codec of what we send "
                       "(protocol/codec.py, docs/codecs.md): float32 (lossless), float16, bfloat16, or "
                       "int<bits>[-b<block>][-p<pct>][-sr|-rn|-sd] (blockwise; -p: seeded sparse, partners must use the "
                       "same), or mod<bits>[-p<pct>][-sd] (the difference to the partner, modulo 2^bits, decoded "
                       "against our own tensors; to a partner of another codec we send int8); partners may send "
                       "in another codec, the state download is always lossless")
    max_message_bytes: int | None = Field(None, gt=0, description="cap on the payload a partner may declare; "
                                          "default: our own tensors at float32, the most a compatible peer sends")
    chunk_bytes: int = Field(1 << 20, ge=4096, le=64 << 20, description="bytes per write before waiting for the "
                             "stream buffer to drain")
    max_streams: int = Field(32, ge=1, le=MAX_STREAMS, description="parallel p2p streams per exchange we initiate "
                             "(one yamux stream alone stalls on links with deep queues or long round trips; as "
                             "responder we follow the initiator, up to the protocol's 64)")
    min_stream_bytes: int = Field(1 << 20, ge=4096, description="payload bytes per extra stream: a payload of B "
                                  "bytes uses min(max_streams, B // min_stream_bytes) streams, at least one")
    fast_link_bytes_per_s: float = Field(50e6, gt=0, description="a partner whose last exchange moved at least "
                                         "this many bytes/s each way is on a fast link: there the CPU, not the "
                                         "stream window, is the limit, and extra streams only cost CPU")
    fast_link_streams: int = Field(4, ge=1, le=MAX_STREAMS, description="streams per exchange with such a partner")
    max_concurrent_handlers: int = Field(8, ge=1, le=1024, description="callers served at once (all but one get "
                                         "BUSY or a rejection); more are closed unread, so strangers cannot "
                                         "pile up work")

    @field_validator("codec")
    @classmethod
    def _known_codec(cls, v: str) -> str:
        return check_name(v)

    @model_validator(mode="before")
    @classmethod
    def _wire_dtype_is_a_codec(cls, data: Any) -> Any:
        # configs written before the codec: exchange.wire_dtype named a cast, which is a codec of the same name
        if isinstance(data, dict) and "wire_dtype" in data:
            data = dict(data)
            old = data.pop("wire_dtype")
            if "codec" in data:
                raise ValueError("exchange.wire_dtype is the old name of exchange.codec: set codec only")
            log.warning("config: exchange.wire_dtype is deprecated, read as exchange.codec = %r", old)
            data["codec"] = old
        return data

    @model_validator(mode="after")
    def _accept_within_exchange(self) -> ExchangeConfig:
        if self.accept_timeout_s > self.exchange_timeout_s:
            raise ValueError(f"accept_timeout_s ({self.accept_timeout_s}) must not exceed exchange_timeout_s "
                             f"({self.exchange_timeout_s})")
        return self


class Outcome(str, Enum):
    ok = "ok"
    busy = "busy"            # the partner (or we) had no free offer: try someone else
    timeout = "timeout"      # a deadline passed
    rejected = "rejected"    # a validation failed on either side; `code` says which
    failed = "failed"        # the stream broke (partner died, p2pd error, garbage mid-stream)


@dataclass
class ExchangeResult:
    outcome: Outcome
    partner: str | None
    code: Code | None
    tensors: list[torch.Tensor] | None
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    detail: str = ""
    role: Literal["initiator", "responder"] = "initiator"
    round: int = -1           # our round of the offer this exchange used
    partner_round: int = -1
    streams: int = 0          # parallel p2p streams the exchange used (0: none opened)
    own_wire: list[torch.Tensor] | None = None   # ok: our tensors as the partner decoded them (None: lossless)
    codec: str = ""           # what we sent / what the partner sent, of an ok exchange, for logs
    mix_weight: float | None = None   # ok: the weight this exchange's codecs warrant (exchange_mix_weight)
    mix_momentum: float | None = None   # ok: the kappa this exchange's codecs warrant (exchange_mix_momentum)

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.ok

    def log_line(self) -> str:
        code = self.code.name if self.code is not None else "-"
        return (f"role={self.role} round={self.round} partner={self.partner} outcome={self.outcome.value} "
                f"code={code} sent_mb={self.bytes_sent / 1e6:.1f} recv_mb={self.bytes_received / 1e6:.1f} "
                f"seconds={self.seconds:.3f} streams={self.streams} detail={self.detail!r}")


@dataclass
class _Engagement:
    """The exchange we are part of right now (at most one)."""
    role: Literal["initiator", "responder"]
    partner: str
    task: asyncio.Task | None
    verdict_sent: bool = False      # past this point cancelling could leave the partner with a one-sided mix

    def __str__(self) -> str:
        return f"{self.role}:{self.partner}"


@dataclass
class _Offer:
    tensors: list[torch.Tensor]
    round: int
    used: bool = False
    wire: list[torch.Tensor] | None = None       # our payload in our codec (a dense codec: once per offer)
    own: list[torch.Tensor] | None = None        # and as the partner decodes it (None: lossless)


async def _maybe_await(v):
    """A membership check may answer at once (a listing) or after a DHT lookup (a coroutine)."""
    return await v if inspect.isawaitable(v) else v


def _failure(exc: BaseException, phase: str) -> tuple[Outcome, Code | None, str]:
    if isinstance(exc, TimeoutError):
        return Outcome.timeout, Code.TIMEOUT, f"deadline passed during {phase}"
    if isinstance(exc, WireError):
        return Outcome.rejected, exc.code, f"{phase}: {exc}"
    return Outcome.failed, None, f"{phase}: {type(exc).__name__}: {exc}"


class Exchanger:
    """Serves and initiates exchanges of the currently offered tensors. Call every method from the event loop."""

    def __init__(self, cfg: ExchangeConfig, p2p: P2P, *, specs: Sequence[SpecLike], fingerprint: str,
                 is_member: Callable[[PeerID], bool | Awaitable[bool]], namespace: str,
                 declines: Callable[[PeerID], str | None] = lambda peer_id: None, swarm_key: bytes | None = None,
                 hints_out: Callable[[str], Sequence[PeerHint]] | None = None,
                 hints_in: Callable[..., None] | None = None,
                 admit: Callable[[PeerID, WireMember | None], bool | Awaitable[bool]] | None = None,
                 member_out: Callable[[], WireMember | None] = lambda: None,
                 members_out: Callable[[str, Sequence[PeerHint]], Sequence[WireMember]] | None = None,
                 members_in: Callable[[str, Sequence[WireMember]], None] | None = None):
        self.cfg, self.p2p = cfg, p2p
        self.specs = [s if isinstance(s, TensorSpec) else TensorSpec.of(*s) for s in specs]
        self.fingerprint, self.is_member = fingerprint, is_member
        # membership of a caller, given the record its request carries (None: an older caller): by default
        # `is_member`; the live peer checks the inline record and looks the caller up only without one
        self.admit = admit or (lambda peer_id, member: is_member(peer_id))
        self.member_out = member_out   # our own signed record, for the requests we send
        self.declines = declines       # partner policy: a reason to answer a valid caller busy, or None
        self.swarm_key = swarm_key     # a private swarm's secret: every exchange proves it (protocol/auth.py)
        # peer exchange (protocol/buckets.py): what we tell a member in our headers, and what it told us
        self.hints_out = hints_out or (lambda partner: ())
        self.hints_in = hints_in or (lambda partner, hints, **seen: None)
        # signed hints: the signed records we hold of the peers our reply hints at, and what to do with those a
        # reply hands us (kept unchecked until we are about to call one: peer/swarm/signed_hints.py)
        self.members_out = members_out or (lambda partner, hints: ())
        self.members_in = members_in
        self.handler_name = f"{namespace}::gasloc.exchange.v{PROTOCOL_VERSION}"
        self.lane_name = f"{namespace}::gasloc.exchange-lane.v{PROTOCOL_VERSION}"
        self._lanes = LaneRegistry(hello_timeout_s=cfg.accept_timeout_s)
        self.max_message_bytes = cfg.max_message_bytes or payload_bytes(self.specs, "float32")
        self.codec: Codec = parse_codec(cfg.codec)
        self.staging = Staging(self.specs, self.codec)
        # the longest header we read: our own request or reply for these specs, fully filled, plus slack
        probe_chars = -(-4 * probe_numel(self.staging.numels) // 3) * 4   # a modulo codec's probe, in base64
        widest = ExchangeRequest(protocol_version=PROTOCOL_VERSION, fingerprint="f" * 128, round=2**62,
                                 codec="c" * MAX_CODEC_CHARS, specs=tuple(self.specs), total_bytes=2**62,
                                 streams=MAX_STREAMS, auth="a" * PROOF_HEX_CHARS, peers=WIDEST_HINTS,
                                 probe_seed=2**63 - 1, probe="p" * probe_chars)
        self.max_header_bytes = max(header_cap(widest.model_copy(update={"member": WIDEST_MEMBER})), header_cap(
            ExchangeReply(protocol_version=PROTOCOL_VERSION, code=0, message="m" * 512, fingerprint=widest.fingerprint,
                          round=widest.round, codec=widest.codec, specs=widest.specs, seed=2**63 - 1,
                          total_bytes=widest.total_bytes, token="t" * 64, auth=widest.auth, peers=WIDEST_HINTS,
                          members=WIDEST_MEMBERS, probe=widest.probe)))
        self.rejected_unread = 0       # callers closed before a byte was read (over the handler cap)
        self._offer: _Offer | None = None
        self._prep: set[asyncio.Task] = set()           # offers' encodings started at offer()
        self._encode_lock = asyncio.Lock()              # one encoding at a time: they share the staging buffers
        self._engagement: _Engagement | None = None
        self._handlers: set[asyncio.Task] = set()
        self._incoming: asyncio.Queue[ExchangeResult] = asyncio.Queue()
        self._started = False
        self._rates: dict[str, float] = {}              # partner -> bytes/s each way of our last exchange

    # ---- lifecycle ----

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(self.handler_name, self._handle)
        await self.p2p.add_binary_stream_handler(self.lane_name, self._lanes.handle)
        self._started = True

    async def stop(self) -> None:
        await self.withdraw()
        if self._prep:   # an offer's encoding in a worker thread: let it end, it writes into our buffers
            await asyncio.wait(list(self._prep), timeout=30)
        for task in list(self._handlers):
            task.cancel()
        if self._started:
            self._started = False
            for name in (self.handler_name, self.lane_name):
                try:
                    async with asyncio.timeout(5.0):
                        await self.p2p.remove_binary_stream_handler(name)
                except (TimeoutError, *STREAM_ERRORS, KeyError) as e:
                    log.debug("remove_handler name=%s error=%s: %s", name, type(e).__name__, e)

    # ---- round API ----

    def offer(self, tensors: Sequence[torch.Tensor], round: int) -> None:
        """Ready for one exchange this round with these outgoing tensors (not copied: keep them unchanged until
        withdraw()). Call `await withdraw()` at the end of the previous round first; results that round left
        uncollected are dropped here with a warning."""
        if len(tensors) != len(self.specs):
            raise ValueError(f"offer of {len(tensors)} tensors, the exchanger expects {len(self.specs)}")
        for i, (t, s) in enumerate(zip(tensors, self.specs)):
            if tuple(t.shape) != s.shape or str(t.dtype).removeprefix("torch.") != s.dtype:
                raise ValueError(f"offered tensor {i} is {tuple(t.shape)} {t.dtype}, expected {s.shape} {s.dtype}")
        if self._engagement is not None:
            raise RuntimeError(f"offer() while engaged ({self._engagement}); await withdraw() first")
        while not self._incoming.empty():
            dropped = self._incoming.get_nowait()
            if dropped.ok:
                log.warning("offer round=%s: dropped an uncollected successful incoming exchange with partner=%s "
                            "(call withdraw() at the end of each round)", round, dropped.partner)
        self._offer = offer = _Offer([t.detach().contiguous() for t in tensors], round)
        if not self.codec.seeded:
            # encode now, in a worker thread while we search or wait: an exchange then starts with the payload ready
            # instead of spending the encode on its own clock (a seeded codec waits for the exchange's seed)
            try:
                task = asyncio.get_running_loop().create_task(self._wire_tensors(offer, 0, None, self.codec))
            except RuntimeError:   # no loop (a test's direct call): the first exchange encodes
                return
            self._prep.add(task)
            task.add_done_callback(self._prep.discard)

    async def encoded(self) -> None:
        """Wait until the offer's payload is encoded (at once when it is, or when a seeded codec encodes per
        exchange). A live peer searches meanwhile; the transport bench waits here so that it times the exchange."""
        if self._prep:
            await asyncio.wait(list(self._prep))

    async def withdraw(self) -> list[ExchangeResult]:
        """End of round: stop accepting and return the incoming results not collected with wait_incoming (an ok one
        means the partner mixed with us, so use it). An incoming exchange in flight is cancelled if our verdict
        is not out yet (the partner then fails too), else awaited: it ends within about one round trip."""
        self._offer = None
        eng = self._engagement
        if eng is not None and eng.role == "responder" and eng.task is not None and not eng.task.done():
            if not eng.verdict_sent:
                eng.task.cancel()
            await asyncio.wait([eng.task])     # never raises; a cancelled responder queues no result
        left = []
        while not self._incoming.empty():
            left.append(self._incoming.get_nowait())
        return left

    def recycle(self, tensors: Sequence[torch.Tensor]) -> None:
        """Hand back the tensors of a finished exchange once you no longer need them: the next exchange receives
        into them instead of fresh memory (for a 100M-parameter model that saves ~0.3 CPU-s of page faults per
        exchange). They will be overwritten; keep no reference you still read."""
        self.staging.recycle(tensors)

    @property
    def engaged(self) -> str | None:
        """"initiator:<peer>" or "responder:<peer>" while an exchange is in flight, else None."""
        return None if self._engagement is None else str(self._engagement)

    def rate(self, partner: str) -> float:
        """Bytes/s each way of our last successful exchange with `partner`; 0.0 if we never had one."""
        return self._rates.get(partner, 0.0)

    async def wait_incoming(self, timeout: float) -> ExchangeResult | None:
        """The next finished exchange where we were the responder (any outcome), or None after `timeout` s."""
        if timeout <= 0:
            return None if self._incoming.empty() else self._incoming.get_nowait()
        try:
            async with asyncio.timeout(timeout):
                return await self._incoming.get()
        except TimeoutError:
            return None

    async def exchange(self, peer_id: PeerID) -> ExchangeResult:
        """Initiate an exchange of the offered tensors with `peer_id`. Never raises for network or partner
        errors: the result's outcome says what happened."""
        offer = self._offer
        if offer is None:
            raise RuntimeError("Exchanger.exchange() called without an offer(); call offer() first")
        partner = str(peer_id)
        t0 = time.monotonic()

        channels: list[Channel] = []

        def result(outcome: Outcome, code: Code | None, detail: str, tensors=None,
                   partner_round: int = -1) -> ExchangeResult:
            r = ExchangeResult(outcome, partner, code, tensors, sum(c.bytes_written for c in channels),
                               sum(c.bytes_read for c in channels), time.monotonic() - t0, detail, "initiator",
                               offer.round, partner_round, len(channels))
            log.log(logging.INFO if r.ok else logging.DEBUG, "exchange %s", r.log_line())
            return r

        if offer.used or self._engagement is not None:
            why = "our offer was already used this round" if offer.used else f"we are engaged ({self._engagement})"
            return result(Outcome.busy, Code.BUSY, f"local: {why}")
        # the membership lookup is part of the call and within its deadline: a DHT get that asks a frozen node
        # waits out that node's RPC timeout (seen: 4.0 s against a 2.5-s exchange deadline, e2e frozen-peer test)
        try:
            async with asyncio.timeout(self.cfg.exchange_timeout_s):
                member = await _maybe_await(self.is_member(peer_id))
        except TimeoutError:
            return result(Outcome.rejected, Code.NOT_MEMBER,
                          "local: partner's membership not confirmed within exchange_timeout_s")
        if not member:
            return result(Outcome.rejected, Code.NOT_MEMBER, "local: partner is not a live member")
        eng = self._engagement = _Engagement("initiator", partner, asyncio.current_task())
        me = self._me()
        phase = "connect"
        total = self.staging.payload_bytes()
        rate = self._rates.get(partner)
        fast = rate is not None and rate >= self.cfg.fast_link_bytes_per_s
        streams = min(self.cfg.fast_link_streams, self.cfg.max_streams) if fast else self.cfg.max_streams
        lanes = lane_count(total, streams, self.cfg.min_stream_bytes)
        try:
            async with asyncio.timeout(self.cfg.exchange_timeout_s):
                async with asyncio.timeout(self.cfg.accept_timeout_s):
                    _, reader, writer = await self.p2p.call_binary_stream_handler(peer_id, self.handler_name)
                    channels.append(Channel.take_over(reader, writer))
                    phase = "handshake"
                    probe_seed, own_probe = 0, None
                    if self.codec.modulo:   # our values at positions of our choosing: the pair's distance sizes the step
                        probe_seed = random.getrandbits(63)
                        own_probe = await in_thread(probe, offer.tensors, probe_seed)
                    request = ExchangeRequest(protocol_version=PROTOCOL_VERSION, fingerprint=self.fingerprint,
                                              round=offer.round, codec=self.codec.name,
                                              specs=tuple(self.specs), total_bytes=total, streams=lanes,
                                              auth=self._proof(EXCHANGE_CALL, me, partner),
                                              peers=wire_hints(self.hints_out(partner)), member=self.member_out(),
                                              members_wanted=MAX_WIRE_MEMBERS if self.members_in else 0,
                                              probe_seed=probe_seed,
                                              probe=probe_text(own_probe) if own_probe is not None else "")
                    await channels[0].write(encode_header(request))
                    reply = await read_header(channels[0], ExchangeReply, self.max_header_bytes)
                    if reply.code != int(Code.NOT_MEMBER):   # a BUSY answer tells us of others, too
                        self.hints_in(partner, from_wire(reply.peers))
                        if self.members_in is not None and reply.members:
                            self.members_in(partner, reply.members)
                    code, why = check_reply(reply, expected_specs=self.specs, fingerprint=self.fingerprint,
                                            max_bytes=self.max_message_bytes, codec=self.codec)
                    if code == Code.BUSY:
                        return result(Outcome.busy, code, f"partner: {why}")
                    if code != Code.OK:
                        return result(Outcome.rejected, code, why)
                    if not proof_ok(self.swarm_key, reply.auth, EXCHANGE_ANSWER, me, partner):
                        # it accepted without proving the key: it is no member of our private swarm, it gets
                        # none of our bytes
                        return result(Outcome.rejected, Code.NOT_AUTHORIZED, "partner did not prove the swarm key")
                    # what we send: our codec, or a modulo peer's fallback for a responder of another codec
                    theirs = parse_codec(reply.codec)
                    send = sent_codec(self.codec, theirs)
                    steps = None
                    if send.modulo:   # both run it; the reply's probe was checked with it: its size, finite values
                        steps = probe_steps(self.codec, self.staging.numels, own_probe,
                                            read_probe(reply.probe, self.staging.numels))
                    if lanes > 1:
                        if not reply.token:
                            return result(Outcome.rejected, Code.BAD_HEADER, "OK reply without a lane token")
                        phase = "opening lanes"
                        channels += await open_lanes(self.p2p, peer_id, self.lane_name, reply.token, lanes)
                phase = "transfer"
                tensors, own, code, why = await self._duplex(channels, offer, theirs, reply.seed, eng, steps, send)
                if code != Code.OK:
                    return result(Outcome.rejected, code, why)
                offer.used = True
                r = result(Outcome.ok, Code.OK, "", tensors, reply.round)
                r.own_wire, r.codec = own, f"{send.name}/{theirs.name}"
                r.mix_weight, r.mix_momentum = exchange_mix_weight(send, theirs), exchange_mix_momentum(send, theirs)
                self._remember_rate(partner, r)
                return r
        except (TimeoutError, WireError, CodecError, *STREAM_ERRORS) as e:
            outcome, code, detail = _failure(e, phase)
            return result(outcome, code, detail)
        finally:
            self._engagement = None
            for c in channels:
                c.close()

    # ---- responder ----

    def _me(self) -> str:
        return self.p2p.peer_id.to_base58()

    def _proof(self, purpose: str, caller: str, callee: str) -> str:
        return "" if self.swarm_key is None else stream_proof(self.swarm_key, purpose, caller, callee)

    async def _handle(self, stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        ch = Channel.take_over(reader, writer)
        if len(self._handlers) >= self.cfg.max_concurrent_handlers:
            # a flood of callers: close unread (an answer would cost a write and a wait per caller)
            self.rejected_unread += 1
            log.debug("exchange role=responder partner=%s refused=handler_cap handlers=%d", stream_info.peer_id,
                      len(self._handlers))
            ch.close()
            return
        task = asyncio.current_task()
        self._handlers.add(task)
        try:
            await self._respond(ch, stream_info.peer_id)
        except asyncio.CancelledError:
            # withdraw()/stop() cancelled us. This task belongs to asyncio's unix server, whose done-callback
            # logs a cancelled handler as an error; the cancellation ends here, at the top of the task.
            log.debug("exchange role=responder partner=%s cancelled", stream_info.peer_id)
        finally:
            self._handlers.discard(task)
            ch.close()

    def _hints_for(self, partner: str, wanted: int) -> tuple[tuple[WireHint, ...], tuple[WireMember, ...]]:
        """Our hints for `partner` and, if it asked for them (`members_wanted`), the signed records we hold of
        the peers they name (an older caller reads replies up to its own widest, which has no room for them)."""
        hints = wire_hints(self.hints_out(partner))
        if not wanted or not hints:
            return hints, ()
        return hints, tuple(self.members_out(partner, from_wire(hints)))[:min(wanted, MAX_WIRE_MEMBERS)]

    async def _reply(self, ch: Channel, partner: str, code: Code, message: str, member: bool = True,
                     wanted: int = 0) -> None:
        log.debug("exchange role=responder partner=%s answer=%s detail=%r", partner, code.name, message)
        # a member answered BUSY learns of other peers (peer exchange); a stranger learns nothing
        hints, members = self._hints_for(partner, wanted) if member else ((), ())
        reply = ExchangeReply(protocol_version=PROTOCOL_VERSION, code=int(code), message=message[:500],
                              fingerprint=self.fingerprint, peers=hints, members=members)
        try:
            async with asyncio.timeout(self.cfg.accept_timeout_s):
                await ch.write(encode_header(reply))
            await ch.discard_until_eof(timeout=min(1.0, self.cfg.accept_timeout_s))
        except (TimeoutError, *STREAM_ERRORS) as e:
            log.debug("exchange role=responder partner=%s reply_failed=%s", partner, type(e).__name__)

    async def _respond(self, ch: Channel, peer_id: PeerID) -> None:
        partner = str(peer_id)
        t0 = time.monotonic()
        # The header first (capped at max_header_bytes, within accept_timeout_s): it carries the caller's own
        # signed record, which proves membership without a DHT lookup. Until membership is proven, an answer
        # names no other peer (member=False).
        try:
            async with asyncio.timeout(self.cfg.accept_timeout_s):
                request = await read_header(ch, ExchangeRequest, self.max_header_bytes)
        except WireError as e:
            return await self._reply(ch, partner, e.code, str(e), member=False)
        except asyncio.IncompleteReadError:
            # the caller closed its side mid-header: it may still read, so it gets its code
            return await self._reply(ch, partner, Code.BAD_HEADER, "the request header was cut short", member=False)
        except TimeoutError:
            return await self._reply(ch, partner, Code.TIMEOUT, "no request header within accept_timeout_s",
                                     member=False)
        except STREAM_ERRORS as e:
            log.debug("exchange role=responder partner=%s no_request=%s: %s", partner, type(e).__name__, e)
            return
        me = self._me()
        # a private swarm's key before membership: a record signed by a peer without the key is nobody's (no
        # such record could enter the swarm's DHT), so it is not even looked at
        if not proof_ok(self.swarm_key, request.auth, EXCHANGE_CALL, partner, me):
            return await self._reply(ch, partner, Code.NOT_AUTHORIZED, "no valid proof of this swarm's key",
                                     member=False)
        # the caller's transport identity (authenticated by p2pd's TLS/Noise) against its record
        if not await _maybe_await(self.admit(peer_id, request.member)):
            return await self._reply(ch, partner, Code.NOT_MEMBER, "you are not a live member of this run",
                                     member=False)
        code, why = check_request(request, expected_specs=self.specs, fingerprint=self.fingerprint,
                                  max_bytes=self.max_message_bytes, codec=self.codec)
        if code == Code.OK:   # a compatible caller is searching for a partner: ready, worth telling others of
            self.hints_in(partner, from_wire(request.peers), state="exchanging", round=request.round)
        if code != Code.OK:
            return await self._reply(ch, partner, code, why)
        wanted = request.members_wanted
        offer = self._offer
        if offer is None or offer.used or self._engagement is not None:
            return await self._reply(ch, partner, Code.BUSY, NO_FREE_OFFER if self._engagement is None
                                     else "engaged in another exchange", wanted=wanted)
        why = self.declines(peer_id)
        if why:
            return await self._reply(ch, partner, Code.BUSY, why, wanted=wanted)
        # what each side sends (checked with the request): our codec and the caller's, or a modulo peer's fallback
        # where the other's codec differs
        named = parse_codec(request.codec)
        send, theirs = sent_codec(self.codec, named), sent_codec(named, self.codec)
        # accepted: from here until the finally, nobody else can engage us (no await between check and set)
        eng = self._engagement = _Engagement("responder", partner, asyncio.current_task())
        outcome, code, detail, tensors, own = Outcome.failed, None, "", None, None
        seed = random.getrandbits(63)   # a seeded codec's blocks or dither: ours to pick, both sides use it
        phase = "accept"
        channels = [ch]
        token, lane_waiters = self._lanes.expect(partner, request.streams)
        try:
            async with asyncio.timeout(self.cfg.exchange_timeout_s):
                steps, own_probe = None, None
                if send.modulo:   # both run it: our values at the caller's positions (its own were checked)
                    own_probe = await in_thread(probe, offer.tensors, request.probe_seed)
                    steps = probe_steps(self.codec, self.staging.numels, own_probe,
                                        read_probe(request.probe, self.staging.numels))
                reply = ExchangeReply(protocol_version=PROTOCOL_VERSION, code=int(Code.OK),
                                      fingerprint=self.fingerprint, round=offer.round, codec=send.name,
                                      specs=tuple(self.specs), seed=seed,
                                      total_bytes=self.staging.payload_bytes(send), token=token,
                                      auth=self._proof(EXCHANGE_ANSWER, partner, me),
                                      peers=wire_hints(self.hints_out(partner)),
                                      probe=probe_text(own_probe) if own_probe is not None else "")
                await ch.write(encode_header(reply))
                if lane_waiters:
                    phase = "waiting for lanes"
                    async with asyncio.timeout(self.cfg.accept_timeout_s):
                        channels += await asyncio.gather(*lane_waiters)
                phase = "transfer"
                tensors, own, code, detail = await self._duplex(channels, offer, theirs, seed, eng, steps, send)
                outcome = Outcome.ok if code == Code.OK else Outcome.rejected
        except (TimeoutError, WireError, CodecError, *STREAM_ERRORS) as e:
            outcome, code, detail = _failure(e, phase)
        finally:
            self._engagement = None
            self._lanes.release(token)      # closes the lanes; `ch` is closed by _handle
        r = ExchangeResult(outcome, partner, code, tensors if outcome is Outcome.ok else None,
                           sum(c.bytes_written for c in channels), sum(c.bytes_read for c in channels),
                           time.monotonic() - t0, detail, "responder", offer.round, request.round, len(channels),
                           own if outcome is Outcome.ok else None, f"{send.name}/{theirs.name}",
                           exchange_mix_weight(send, theirs), exchange_mix_momentum(send, theirs))
        if r.ok:
            offer.used = True
            self._remember_rate(partner, r)
        log.log(logging.INFO if r.ok else logging.DEBUG, "exchange %s", r.log_line())
        self._incoming.put_nowait(r)     # collected by wait_incoming() or withdraw()

    # ---- both roles ----

    def _remember_rate(self, partner: str, r: ExchangeResult) -> None:
        if len(self._rates) >= 4096:               # bounded: forget the oldest partner
            self._rates.pop(next(iter(self._rates)))
        self._rates.pop(partner, None)
        self._rates[partner] = max(r.bytes_sent, r.bytes_received) / max(r.seconds, 1e-6)

    async def _wire_tensors(self, offer: _Offer, seed: int, steps: list[float] | None, send: Codec
                            ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Our payload in `send` and our own wire form, encoded in a worker thread once per offer (a seeded
        codec: once per exchange, its blocks or its dither drawn from the exchange's seed, a modulo codec's steps
        from both sides' probes). `send` other than our codec (a modulo peer's fallback): encoded for this exchange
        into buffers of its own, which the result keeps (the own wire form) until the daemon's mix."""
        if send != self.codec:
            staging = Staging(self.specs, send)

            def fallback():
                wire = staging.encode(offer.tensors, seed)
                return wire, staging.own_wire(wire, offer.tensors, seed)
            return await in_thread(fallback)
        async with self._encode_lock:
            if offer.wire is None or self.codec.seeded:
                def encode():
                    wire = self.staging.encode(offer.tensors, seed, steps)
                    return wire, self.staging.own_wire(wire, offer.tensors, seed)
                offer.wire, offer.own = await in_thread(encode)
            return offer.wire, offer.own

    async def _pipelined(self, channels: list[Channel], offer: _Offer, codec: Codec, seed: int, steps: list[float],
                         bufs: list[torch.Tensor], out: list[torch.Tensor]) -> list[int]:
        """A modulo codec's transfer: its payload can only be encoded once the handshake agreed the steps (from both
        sides' probes), so instead of encoding all, sending all, then decoding all, each lane's share of tensor k
        goes out as soon as it is encoded (a worker thread encodes them in order, chunk by chunk: lanes.Watermark)
        and their bytes are decoded as they land (peer/transport/landing.py), each against our own tensor and our
        payload of it once that is encoded. The bytes are the same as the plain path's. Returns the indices of
        their tensors that are not finite after decoding."""
        loop = asyncio.get_running_loop()
        encoded = [Watermark(loop) for _ in offer.tensors]
        stop = threading.Event()
        async with self._encode_lock:     # the send buffers are the staging's own
            ours = self.staging.send_buffers(offer.tensors)
            landing = Landing(self.staging, codec, bufs, out, seed, offer.tensors, ours, steps, ready=encoded)

            def encode() -> None:
                for k, t in enumerate(offer.tensors):
                    if stop.is_set():    # the transfer failed: do not spend a thread on bytes nobody reads
                        return
                    self.staging.encode_one(k, t, seed, steps[k], progress=encoded[k].advance)

            encoder = loop.run_in_executor(None, encode)

            async def encoding() -> None:   # an encode that raises fails the transfer (a send would wait for ever)
                await asyncio.shield(encoder)

            try:
                return (await gather_or_cancel([encoding(), landing.run(), move(
                    channels, ours, bufs, self.cfg.chunk_bytes, ready=encoded, **landing.hooks())]))[1]
            finally:
                # the encoder writes into the send buffers: it ends (at the next tensor) before the lock is let go
                stop.set()
                await asyncio.wait([encoder])
                if not encoder.cancelled():
                    encoder.exception()      # retrieved (raised above, if the transfer was still on)

    async def _duplex(self, channels: list[Channel], offer: _Offer, codec: Codec, seed: int, eng: _Engagement,
                      steps: list[float] | None, send: Codec
                      ) -> tuple[list[torch.Tensor] | None, list[torch.Tensor] | None, Code, str]:
        """Send ours (in `send`) and receive theirs (in `codec`) at once over all lanes, then trade verdicts on the
        control stream. Returns (their tensors decoded, our own wire form, OK, "") only when both sides accepted;
        otherwise (None, None, the code, why)."""
        # every buffer is sized from OUR specs (validated equal to theirs) and the codec: a partner cannot make us
        # allocate more
        bufs, out = self.staging.receive_buffers(codec)
        if codec.modulo and send.modulo and steps is not None:
            own, bad = None, await self._pipelined(channels, offer, codec, seed, steps, bufs, out)
        else:
            ours, own = await self._wire_tensors(offer, seed, steps, send)
            fill = own if own is not None else offer.tensors
            ref = ours if codec.modulo else None
            if codec.decodes_ranges:   # each lane's share decoded as it lands, beside the transfer
                landing = Landing(self.staging, codec, bufs, out, seed, fill, ref, steps)
                bad = (await gather_or_cancel([landing.run(), move(channels, ours, bufs, self.cfg.chunk_bytes,
                                                                    **landing.hooks())]))[0]
            else:   # a cast (a copy, or nothing but the finite check) or a sparse code: after the last byte
                await move(channels, ours, bufs, self.cfg.chunk_bytes)
                bad = await in_thread(self.staging.decode, codec, bufs, out, seed, fill, ref, steps)
        ch = channels[0]
        verdict = Code.NOT_FINITE if bad else Code.OK
        eng.verdict_sent = True
        await ch.write(bytes([verdict]))
        theirs = Code.parse((await ch.readexactly(1))[0])
        if verdict != Code.OK:
            self.staging.recycle(out)
            return None, None, verdict, f"partner sent non-finite values in tensor(s) {bad[:5]}"
        if theirs != Code.OK:
            self.staging.recycle(out)
            return None, None, theirs, f"partner rejected our tensors: {theirs.voice}"
        return out, own, Code.OK, ""
