"""A zero-copy byte channel over one hivemind p2pd stream.

hivemind hands a binary stream to us as an asyncio (StreamReader, StreamWriter) pair on a unix socket to p2pd. A
StreamReader copies every byte three times (recv -> bytes -> its bytearray -> the bytes it returns) and cannot read
into memory we own. `Channel.take_over` swaps the transport's protocol for this BufferedProtocol
(`transport.set_protocol`, public asyncio API, also implemented by uvloop), so the kernel writes tensor bytes
straight into preallocated tensors (`readinto`). Writes go to the transport in chunks with explicit flow control.

Memory bound: bytes that arrive while no read is pending go to a staging buffer; past STAGING_LIMIT_BYTES we stop
reading the socket (p2pd and the peer then see backpressure). A peer can never make us hold more than that plus one
scratch read (_SCRATCH_BYTES) per stream, besides the buffers we chose to read into.

Every method that waits can be cancelled (callers wrap exchanges in asyncio.timeout); a closed or reset connection
raises ConnectionResetError, an EOF in the middle of a read raises asyncio.IncompleteReadError.
"""
from __future__ import annotations

import asyncio
from typing import Any, TypeVar

from hivemind.p2p import P2PDaemonError, P2PHandlerError
from pydantic import BaseModel

from gasloc.protocol.wire import LENGTH_PREFIX_BYTES, MAX_HEADER_BYTES, decode_header, parse_length

STAGING_LIMIT_BYTES = 1 << 18
_SCRATCH_BYTES = 1 << 16
WRITE_HIGH_WATER_BYTES = 1 << 20
WRITE_LOW_WATER_BYTES = 1 << 18

H = TypeVar("H", bound=BaseModel)

# What a broken stream or p2pd can raise (ControlFailure and DispatchFailure are P2PDaemonErrors). Callers map
# these to a "failed" outcome; anything else is a bug and propagates.
STREAM_ERRORS = (ConnectionError, asyncio.IncompleteReadError, P2PDaemonError, P2PHandlerError, EOFError, OSError)


class Channel(asyncio.BufferedProtocol):
    """The reading and writing side of one stream; create with `take_over(reader, writer)`."""

    def __init__(self, transport: asyncio.Transport):
        self._transport = transport
        self._loop = asyncio.get_running_loop()
        self._staging = bytearray()          # bytes received while no read target was set
        self._scratch = bytearray(_SCRATCH_BYTES)
        self._scratch_mv = memoryview(self._scratch)
        self._target: memoryview | None = None
        self._target_off = 0
        self._read_waiter: asyncio.Future[None] | None = None
        self._write_waiter: asyncio.Future[None] | None = None
        self._eof = False
        self._lost: BaseException | None = None
        self._reading_paused = False
        self._into_target = False
        self._discarding = False
        self._eof_waiter: asyncio.Future[None] | None = None
        self._stream_pair: tuple[Any, Any] | None = None
        self.bytes_read = 0
        self.bytes_written = 0

    @classmethod
    def take_over(cls, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Channel:
        """Become the protocol of `writer`'s transport; bytes `reader` already buffered are kept, in order.

        `reader._buffer` is private, but it is the only place those bytes exist (hivemind's handler dispatch reads
        the stream header through the StreamReader, which may read ahead into our first bytes).
        """
        transport = writer.transport
        ch = cls(transport)  # type: ignore[arg-type]
        # StreamWriter.__del__ closes the transport: the channel keeps the pair alive as long as it lives
        ch._stream_pair = (reader, writer)
        buffered = getattr(reader, "_buffer", None)
        if buffered:
            ch._staging.extend(buffered)
            buffered.clear()
        ch._eof = reader.at_eof() or bool(getattr(reader, "_eof", False))
        transport.set_protocol(ch)
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER_BYTES, low=WRITE_LOW_WATER_BYTES)
        if transport.is_closing():
            ch._lost = ConnectionResetError("stream closed before it was taken over")
        else:
            # the StreamReader may have paused reading when its buffer filled; we decide from now on
            transport.resume_reading()
        return ch

    # ---- asyncio.BufferedProtocol callbacks (run on the event loop) ----

    def get_buffer(self, sizehint: int) -> Any:
        # zero-copy when nothing older is staged: the kernel writes straight into the caller's tensor
        self._into_target = self._target is not None and not self._staging
        if self._into_target:
            return self._target[self._target_off:]
        return self._scratch_mv

    def buffer_updated(self, nbytes: int) -> None:
        self.bytes_read += nbytes
        if self._discarding:
            return
        if self._into_target:
            self._target_off += nbytes
            if self._target_off == len(self._target):
                self._target = None
                self._wake_reader(None)
            return
        self._staging.extend(self._scratch_mv[:nbytes])
        if self._target is not None:
            self._fill_from_staging()
        if len(self._staging) >= STAGING_LIMIT_BYTES and not self._reading_paused:
            self._reading_paused = True
            self._transport.pause_reading()

    def eof_received(self) -> bool:
        self._eof = True
        self._wake_eof()
        if self._target is not None:
            self._wake_reader(asyncio.IncompleteReadError(b"", len(self._target) - self._target_off))
        return True   # keep the transport open: we may still have a verdict byte to write

    def connection_lost(self, exc: BaseException | None) -> None:
        self._lost = exc if isinstance(exc, ConnectionError) else ConnectionResetError(f"stream closed: {exc}")
        self._eof = True
        self._wake_eof()
        if self._target is not None:
            self._wake_reader(self._lost)
        self._wake_writer(self._lost)

    def pause_writing(self) -> None:
        pass  # flow control is decided in _drain from the transport's buffer size

    def resume_writing(self) -> None:
        self._wake_writer(None)

    # ---- helpers ----

    def _wake_reader(self, exc: BaseException | None) -> None:
        w, self._read_waiter = self._read_waiter, None
        if w is not None and not w.done():
            w.set_exception(exc) if exc is not None else w.set_result(None)

    def _wake_writer(self, exc: BaseException | None) -> None:
        w, self._write_waiter = self._write_waiter, None
        if w is not None and not w.done():
            w.set_exception(exc) if exc is not None else w.set_result(None)

    def _wake_eof(self) -> None:
        if self._eof_waiter is not None and not self._eof_waiter.done():
            self._eof_waiter.set_result(None)

    def _fill_from_staging(self) -> None:
        assert self._target is not None
        n = min(len(self._staging), len(self._target) - self._target_off)
        self._target[self._target_off:self._target_off + n] = self._staging[:n]
        del self._staging[:n]    # bytearray front deletion is O(1) amortized in CPython
        self._target_off += n
        if self._target_off == len(self._target):
            self._target = None
            self._wake_reader(None)
        if self._reading_paused and len(self._staging) < STAGING_LIMIT_BYTES:
            self._reading_paused = False
            self._transport.resume_reading()

    # ---- public API ----

    async def readinto(self, buf: memoryview | bytearray) -> None:
        """Fill `buf` completely (a writable, byte-formatted buffer: e.g. a tensor's uint8 numpy view)."""
        view = memoryview(buf).cast("B")
        if len(view) == 0:
            return
        if self._read_waiter is not None:
            raise RuntimeError("Channel.readinto called concurrently")
        self._target, self._target_off = view, 0
        self._read_waiter = self._loop.create_future()
        waiter = self._read_waiter
        self._fill_from_staging()
        if self._target is not None:
            if self._lost is not None:
                self._wake_reader(self._lost)
            elif self._eof:
                self._wake_reader(asyncio.IncompleteReadError(bytes(view[:self._target_off]), len(view)))
        try:
            await waiter
        finally:
            self._target = None
            self._read_waiter = None

    async def readexactly(self, n: int) -> bytes:
        buf = bytearray(n)
        await self.readinto(buf)
        return bytes(buf)

    async def write(self, data: memoryview | bytes, chunk_bytes: int = 1 << 20) -> None:
        """Send all of `data`, at most `chunk_bytes` at a time, waiting while the transport buffer is full."""
        view = memoryview(data).cast("B")
        for off in range(0, len(view), chunk_bytes):
            if self._lost is not None:
                raise self._lost
            self._transport.write(view[off:off + chunk_bytes])
            self.bytes_written += min(chunk_bytes, len(view) - off)
            await self._drain()

    async def _drain(self) -> None:
        while self._lost is None and self._transport.get_write_buffer_size() > WRITE_HIGH_WATER_BYTES:
            self._write_waiter = self._loop.create_future()
            await self._write_waiter
        if self._lost is not None:
            raise self._lost

    async def discard_until_eof(self, timeout: float) -> None:
        """Drop everything the peer still sends until it closes, for at most `timeout` s, then return.

        Used after a rejection reply: closing at once while the peer is still sending makes p2pd reset the stream,
        and a reset can destroy our reply in flight. Discarding keeps memory bounded whatever the peer pushes.
        """
        self._discarding = True
        self._staging.clear()
        if self._reading_paused:
            self._reading_paused = False
            self._transport.resume_reading()
        if self._eof or self._lost is not None:
            return
        self._eof_waiter = self._loop.create_future()
        try:
            async with asyncio.timeout(timeout):
                await self._eof_waiter
        except TimeoutError:
            pass    # a peer that keeps pushing gets closed on: it had its answer for `timeout` seconds
        finally:
            self._eof_waiter = None

    def close(self) -> None:
        if not self._transport.is_closing():
            self._transport.close()

    def abort(self) -> None:
        """Close without flushing (on failure: the peer sees a reset, not a clean end)."""
        self._transport.abort()


async def read_header(ch: Channel, cls: type[H], max_bytes: int = MAX_HEADER_BYTES) -> H:
    """Read one length-prefixed header frame of at most `max_bytes`; WireError when it is oversized or malformed
    (an oversized one before a byte of its body is read)."""
    n = parse_length(await ch.readexactly(LENGTH_PREFIX_BYTES), max_bytes)
    return decode_header(await ch.readexactly(n), cls)
