"""One side of the transport benchmark (bench/transport.py starts two of these, maybe inside network namespaces).

Role a listens, role b initiates. The orchestrator drives both over stdin/stdout, one JSON object per line:
    -> {"op": "prepare", "key": K, "method": M, "sizes": [N, ...], "wire": W}   <- {"ok": true}
    -> {"op": "arm", "key": K}          (averager: step until AWAITING_TRIGGER)   <- {"ok": true}
    -> {"op": "go", "key": K}           (a: wait for its side; b: run it)         <- {"seconds": s, "check": ...}
    -> {"op": "drop", "key": K}  /  {"op": "exit"}
Every method moves the same payload both ways at once and ends with both sides holding the partner's tensors; the
time is taken by the initiator (b) from the first call to the end (a one-byte ack from a closes it), except the
averager, which both trigger and time from allow_allreduce() to result() (the slower side counts).
Logs go to stderr; stdout carries only the JSON lines.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import sys
import time

import torch

from gasloc.runtime.procs import set_pdeathsig

CHUNK = 1 << 20
NS = "gxbench"
log = logging.getLogger("transport_worker")


def die_with_parent() -> None:
    set_pdeathsig(signal.SIGKILL)     # runtime/procs.py loads libc at import, not in the forked DHT/averager child


def make_tensors(sizes: list[int], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) for n in sizes]


def views(ts):
    return [t.reshape(-1).view(torch.uint8).numpy() for t in ts]


SAMPLE = 4096


def digest(ts: list[torch.Tensor]) -> list[tuple[float, torch.Tensor]]:
    """What a received list is checked against, without keeping a second copy of 100M parameters: per tensor, the
    float64 sum and the first SAMPLE values."""
    return [(float(t.double().sum()), t.reshape(-1)[:SAMPLE].float().clone()) for t in ts]


def check(got, want_digest, wire: str, exact: bool = True, own_digest=None) -> str:
    """"ok" when `got` matches the digest: bit-exact for a float32 transfer, within 16-bit rounding otherwise, and
    within float32 rounding for the averager's float32 mean (`exact=False`); a blockwise codec within one step of
    its scale (a modulo codec: of the pair's step, from `own_digest`), and its sum within six standard deviations of
    stochastic rounding's noise. Else "MISMATCH" with what
    differs, so a rare failure says whether the values are off a little or not averaged at all."""
    from gasloc.protocol.codec import RANGE_RMS, parse
    codec = parse(wire)
    if codec.block:
        for i, (t, (total, head)) in enumerate(zip(got, want_digest)):
            if codec.modulo:   # the pair's step: its code range spans RANGE_RMS of their difference (2x: the probes'
                #                estimate of it); decoded against our own tensors, within a step of the partner's
                rms = float((head - own_digest[i][1]).square().mean().sqrt())
                step = 2 * RANGE_RMS * rms / (1 << (codec.bits - 1))
            else:
                step = float(head.abs().max()) / ((1 << (codec.bits - 1)) - 1) * 2   # a block's max may exceed the head's
            diff = (t.reshape(-1)[:SAMPLE].float() - head).abs()
            total_got = float(t.double().sum())
            if float(diff.max()) > step or abs(total_got - total) > 6 * step * t.numel() ** 0.5:
                return (f"MISMATCH tensor {i} ({wire}): max |diff| {float(diff.max()):.3g} against a step of "
                        f"{step:.3g}, sum {total_got:.6g} against {total:.6g}")
        return "ok"
    tol = 2e-3 if wire != "float32" else (0.0 if exact else 1e-6)
    for i, (t, (total, head)) in enumerate(zip(got, want_digest)):
        h = t.reshape(-1)[:SAMPLE].float()
        total_got = float(t.double().sum())
        same = (torch.equal(h, head) and total_got == total if tol == 0.0 else
                torch.allclose(h, head, rtol=tol, atol=tol)
                and abs(total_got - total) <= tol * (t.numel() ** 0.5 + abs(total)))
        if not same:
            diff = (h - head).abs()
            off = int((diff > tol * (1 + head.abs())).sum())
            return (f"MISMATCH tensor {i} of {len(want_digest)}: {off} of the first {len(h)} values off "
                    f"(max |diff| {float(diff.max()):.3g}), sum {total_got:.6g} against {total:.6g}")
    return "ok"


class Worker:
    def __init__(self, args):
        self.args = args
        self.role = args.role
        self.host = args.host
        self.tcp_listener: socket.socket | None = None
        self.p2p = None
        self.dht = None
        self.state: dict[str, dict] = {}
        self.bundles: dict[tuple, dict] = {}   # per (tensor sizes, wire): our tensors, receive buffers, digests
        self.raw_pending: asyncio.Future | None = None

    # ---- setup ----

    async def setup(self) -> dict:
        from hivemind.p2p import P2P
        initial = [self.args.peer_maddr] if self.args.peer_maddr else None
        self.p2p = await P2P.create(host_maddrs=[f"/ip4/{self.host}/tcp/0"], initial_peers=initial)
        info = {"maddr": str((await self.p2p.get_visible_maddrs())[0]), "peer_id": str(self.p2p.peer_id)}
        if self.role == "a":
            self.tcp_listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self.tcp_listener.bind((self.host, 0))
            self.tcp_listener.listen(4)
            self.tcp_listener.setblocking(False)
            info["tcp_port"] = self.tcp_listener.getsockname()[1]
            await self.p2p.add_binary_stream_handler(f"{NS}::raw", self._raw_handler)
        if self.args.with_dht:
            self.dht = make_dht(self.host, self.args.peer_dht)
            info["dht_maddrs"] = [str(m) for m in self.dht.get_visible_maddrs()]
        return info

    async def shutdown(self) -> None:
        for key in list(self.state):
            await self.drop(key)
        if self.dht is not None:
            shutdown_and_unlink(self.dht)
        if self.p2p is not None:
            await self.p2p.shutdown()
        if self.tcp_listener is not None:
            self.tcp_listener.close()

    # ---- per-configuration state ----

    async def prepare(self, key: str, method: str, sizes: list[int], wire: str) -> dict:
        seed_mine, seed_theirs = (1, 2) if self.role == "a" else (2, 1)
        if (tuple(sizes), wire) not in self.bundles:
            self.bundles.clear()      # one configuration at a time: bounded memory
            theirs = make_tensors(sizes, seed_theirs)
            own = make_tensors(sizes, seed_mine)
            from gasloc.protocol.codec import parse as parse_codec
            if parse_codec(wire).modulo:   # a modulo code assumes close partners: 2.5 % of a weight apart, as live
                base = make_tensors(sizes, 0)
                own, theirs = ([b + 0.025 * t for b, t in zip(base, ts)] for ts in (own, theirs))
                del base
            self.bundles[(tuple(sizes), wire)] = {
                "own": own, "own_digest": digest(own), "want": digest(theirs),
                "avg": digest([(a + b) / 2 for a, b in zip(own, theirs)]),
                # tcp and the raw stream move a cast's bytes; a blockwise codec is the exchange's alone
                "recv": [torch.empty(n, dtype=getattr(torch, wire, torch.uint8)) for n in sizes]}
            del theirs
        b = self.bundles[(tuple(sizes), wire)]
        st = {"method": method, "params": sum(sizes), "wire": wire, "own": b["own"], "own_digest": b["own_digest"],
              "want": b["want"], "recv": b["recv"]}
        if method == "gasloc":
            from gasloc.peer.transport.exchange import ExchangeConfig, Exchanger
            cfg = ExchangeConfig(codec=wire, exchange_timeout_s=3600, accept_timeout_s=60,
                                 max_streams=self.args.max_streams)
            ex = Exchanger(cfg, self.p2p, specs=[(t.shape, t.dtype) for t in st["own"]], fingerprint="bench",
                           is_member=lambda peer: True, namespace=f"{NS}{key}")
            await ex.start()
            st["ex"] = ex
        elif method == "hivemind_averager":
            from hivemind.compression import Float16Compression, NoCompression
            st["want"] = b["avg"]
            st["averager"] = make_averager([t.clone() for t in st["own"]], self.dht, f"{NS}{key}",
                                           Float16Compression() if wire == "float16" else NoCompression())
        self.state[key] = st
        return {"ok": True}

    async def drop(self, key: str) -> dict:
        st = self.state.pop(key, None)
        if st and "ex" in st:
            await st["ex"].stop()
        if st and "averager" in st:
            shutdown_and_unlink(st["averager"])
        return {"ok": True}

    async def arm(self, key: str) -> dict:
        st = self.state[key]
        method = st["method"]
        if method == "tcp" and self.role == "a":
            st["pending"] = asyncio.ensure_future(self._tcp_accept(st))
        elif method == "hivemind_raw_stream" and self.role == "a":
            self.raw_pending = asyncio.get_running_loop().create_future()
            st["pending"] = self.raw_pending
            self.raw_st = st
        elif method == "gasloc":
            await st["ex"].withdraw()
            st["ex"].offer(st["own"], round=0)
            await st["ex"].encoded()   # as a live peer's offer is encoded while it searches: the exchange is timed
            if self.role == "a":
                st["pending"] = asyncio.ensure_future(st["ex"].wait_incoming(3600))
        elif method == "hivemind_averager":
            from hivemind.averaging.control import AveragingStage
            from hivemind.utils import get_dht_time
            ctl = st["averager"].step(wait=False, require_trigger=True, scheduled_time=get_dht_time() + 2,
                                      timeout=3600)
            deadline = time.monotonic() + 120
            while ctl.stage != AveragingStage.AWAITING_TRIGGER:
                if ctl.done() or time.monotonic() > deadline:
                    raise RuntimeError(f"averager did not find a group: {ctl.exception() if ctl.done() else ''}")
                await asyncio.sleep(0.01)       # StepControl offers no awaitable for the stage; poll it
            st["ctl"] = ctl
        return {"ok": True}

    async def go(self, key: str) -> dict:
        st = self.state[key]
        method, wire = st["method"], st["wire"]
        t0 = time.perf_counter()
        if method == "hivemind_averager":
            ctl = st.pop("ctl")
            ctl.allow_allreduce()
            await asyncio.get_running_loop().run_in_executor(None, ctl.result)
            seconds = time.perf_counter() - t0
            with st["averager"].get_tensors() as got:
                verdict = check(list(got), st["want"], wire, exact=False)
            return {"seconds": seconds, "check": verdict}
        if self.role == "a":
            got = await st.pop("pending")
            seconds = time.perf_counter() - t0          # only how long a waited; b's time is the measurement
            if method == "gasloc":
                if got is None or not got.ok:
                    raise RuntimeError(f"gasloc incoming exchange failed: {got and got.log_line()}")
                got = got.tensors
        else:
            if method == "tcp":
                got = await self._tcp_connect(st)
            elif method == "hivemind_raw_stream":
                got = await self._raw_call(st)
            else:
                res = await st["ex"].exchange(self._peer_id())
                if not res.ok:
                    raise RuntimeError(f"gasloc exchange failed: {res.log_line()}")
                got = res.tensors
            seconds = time.perf_counter() - t0
        verdict = check(got, st["want"], wire, own_digest=st["own_digest"])
        if method == "gasloc":
            st["ex"].recycle(got)        # as the daemon does once it mixed: the next exchange reuses the memory
        return {"seconds": seconds, "check": verdict}

    def _peer_id(self):
        from hivemind.p2p import PeerID
        return PeerID.from_base58(self.args.peer_maddr.rsplit("/p2p/", 1)[1])

    # ---- tcp: asyncio sockets, sock_recv_into straight into preallocated tensors ----

    async def _cast_out(self, st) -> list[torch.Tensor]:
        if st["wire"] == "float32":
            return st["own"]
        return await asyncio.to_thread(lambda: [t.to(getattr(torch, st["wire"])) for t in st["own"]])

    async def _cast_in(self, st) -> list[torch.Tensor]:
        if st["wire"] == "float32":
            return st["recv"]
        return await asyncio.to_thread(lambda: [t.float() for t in st["recv"]])

    async def _tcp_duplex(self, sock: socket.socket, st) -> list[torch.Tensor]:
        loop = asyncio.get_running_loop()
        out = await self._cast_out(st)

        async def send():
            for v in views(out):
                await loop.sock_sendall(sock, memoryview(v))

        async def recv():
            for v in views(st["recv"]):
                mv, off = memoryview(v), 0
                while off < len(mv):
                    n = await loop.sock_recv_into(sock, mv[off:])
                    if n == 0:
                        raise ConnectionError("peer closed")
                    off += n

        await asyncio.gather(send(), recv())
        await loop.sock_sendall(sock, b"\x01")
        if await loop.sock_recv(sock, 1) != b"\x01":
            raise ConnectionError("no ack")
        return await self._cast_in(st)

    async def _tcp_accept(self, st):
        loop = asyncio.get_running_loop()
        sock, _ = await loop.sock_accept(self.tcp_listener)
        with sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return await self._tcp_duplex(sock, st)

    async def _tcp_connect(self, st):
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        with sock:
            await loop.sock_connect(sock, (self.args.peer_host, self.args.peer_tcp))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return await self._tcp_duplex(sock, st)

    # ---- hivemind raw binary stream, used as documented: StreamWriter.write+drain, StreamReader.readexactly ----

    async def _raw_duplex(self, reader, writer, st) -> list[torch.Tensor]:
        out = await self._cast_out(st)

        async def send():
            for v in views(out):
                v = memoryview(v)    # transport.write wants a bytes-like object, not an ndarray
                for off in range(0, len(v), CHUNK):
                    writer.write(v[off:off + CHUNK])
                    await writer.drain()

        async def recv():
            for v in views(st["recv"]):
                for off in range(0, len(v), CHUNK):
                    data = await reader.readexactly(min(CHUNK, len(v) - off))
                    v[off:off + len(data)] = memoryview(data)

        await asyncio.gather(send(), recv())
        writer.write(b"\x01")
        await writer.drain()
        await reader.readexactly(1)
        return await self._cast_in(st)

    async def _raw_handler(self, info, reader, writer):
        fut, st = self.raw_pending, self.raw_st
        try:
            got = await self._raw_duplex(reader, writer, st)
            fut.set_result(got)
        except Exception as e:       # report to the orchestrator through the future, whatever it was
            fut.set_exception(e)
        finally:
            writer.close()

    async def _raw_call(self, st):
        _, reader, writer = await self.p2p.call_binary_stream_handler(self._peer_id(), f"{NS}::raw")
        try:
            return await self._raw_duplex(reader, writer, st)
        finally:
            writer.close()


def shutdown_and_unlink(proc) -> None:
    """Shut down a hivemind DHT or averager process and remove the socket files it leaves behind (hivemind does
    not); only files bound by that process and its children, noted while they live."""
    from gasloc.runtime.sockets import owned_sockets, remove, subtree
    # a forked child also holds the listening sockets it inherited from us: those stay (we still serve on them)
    sockets = owned_sockets(subtree(proc.pid)) - owned_sockets([os.getpid()])
    proc.shutdown()
    remove(sockets)


def make_dht(host: str, peer_dht: list[str] | None):
    import hivemind

    class SafeDHT(hivemind.DHT):
        def run(self):
            die_with_parent()        # the forked DHT process dies with this worker (docs/hivemind.md §5)
            super().run()

    return SafeDHT(initial_peers=peer_dht or None, host_maddrs=[f"/ip4/{host}/tcp/0"], start=True)


def make_averager(tensors, dht, prefix, compression):
    from hivemind.averaging import DecentralizedAverager

    class SafeAverager(DecentralizedAverager):
        def run(self):
            die_with_parent()
            super().run()

    return SafeAverager(tensors, dht, start=True, prefix=prefix, target_group_size=2, min_group_size=2,
                        min_matchmaking_time=1.0, request_timeout=10.0, allreduce_timeout=3600,
                        next_chunk_timeout=120, compression=compression)


async def main(args) -> None:
    worker = Worker(args)
    out = sys.stdout

    def reply(obj):
        out.write(json.dumps(obj) + "\n")
        out.flush()

    try:
        reply({"ready": await worker.setup()})
        while True:
            line = await asyncio.to_thread(sys.stdin.readline)
            if not line:
                break
            cmd = json.loads(line)
            op = cmd.pop("op")
            if op == "exit":
                break
            try:
                reply(await getattr(worker, op)(**cmd))
            except (RuntimeError, ConnectionError, OSError, asyncio.IncompleteReadError) as e:
                reply({"error": f"{type(e).__name__}: {e}"})
    finally:
        await worker.shutdown()


if __name__ == "__main__":
    die_with_parent()
    p = argparse.ArgumentParser()
    p.add_argument("--role", choices=["a", "b"], required=True)
    p.add_argument("--host", required=True)
    p.add_argument("--peer-host")
    p.add_argument("--peer-tcp", type=int)
    p.add_argument("--peer-maddr")
    p.add_argument("--peer-dht", nargs="*")
    p.add_argument("--with-dht", action="store_true")
    p.add_argument("--uvloop", action="store_true")
    p.add_argument("--max-streams", type=int, default=32)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    parsed = p.parse_args()
    if parsed.uvloop:
        import uvloop
        uvloop.install()
    asyncio.run(main(parsed))
