"""The control pipe between a peer and its hivemind DHT child, without a socket handshake per call.

Every call to hivemind's DHT (get, store, run_coroutine) sends an MPFuture down a pipe to the DHT process, and an
MPFuture pickles its `_sender_pipe`: the Connection on which the DHT process sends the result back. That is the
same Connection for every future of our process (MPFuture's per-process backend pipe), but multiprocessing
pickles a Connection as a file descriptor to hand over through its resource sharer: for every call, our process
opens a listener connection, both sides run the HMAC challenge in both directions, the descriptor travels by
SCM_RIGHTS, and the DHT process rebuilds and later closes a Connection around it. Measured per DHT get at 256
members: about 3.7 ms of the DHT process's profile in `rebuild_connection` alone, plus the sharer thread in ours.

The DHT child is forked after that Connection exists (hivemind's `DHT.__init__` makes its `_ready` MPFuture before
the fork), so the child already holds it. `FuturePipe` sends that one object by reference (pickle's persistent id)
and the child resolves the reference to its inherited copy; any other Connection (a backend that was reset, a
future of another process) is pickled as hivemind always did. Results still travel on the same pipe, under
MPFuture's lock, so nothing about ordering or concurrency changes.
"""
from __future__ import annotations

import io
import pickle
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler

_SENDER = "gasloc:mpfuture-sender"   # the persistent id of the inherited result pipe


class _Pickler(ForkingPickler):
    def __init__(self, file, sender: Connection):
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self._sender = sender

    def persistent_id(self, obj):
        return _SENDER if obj is self._sender else None


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, sender: Connection):
        super().__init__(file)
        self._sender = sender

    def persistent_load(self, pid):
        if pid != _SENDER:
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        return self._sender


class FuturePipe:
    """One end of a DHT control pipe (hivemind's `_outer_pipe` or `_inner_pipe`) that passes `sender` (the
    MPFuture result pipe both processes hold since the fork) by reference. Everything but send/recv is the
    wrapped Connection's."""

    def __init__(self, conn: Connection, sender: Connection):
        self._conn, self._sender = conn, sender

    def send(self, obj) -> None:
        buf = io.BytesIO()
        _Pickler(buf, self._sender).dump(obj)
        self._conn.send_bytes(buf.getbuffer())

    def recv(self):
        return _Unpickler(io.BytesIO(self._conn.recv_bytes()), self._sender).load()

    def __getattr__(self, name):
        return getattr(self._conn, name)
