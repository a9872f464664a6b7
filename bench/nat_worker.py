"""One host of the NAT benchmark (bench/nat.py starts one of these in each NAT-lab namespace it uses).

Each worker runs one hivemind p2pd (P2P.create, the options given on the command line), gasloc's RoutedP2P and
RelayService on it (the forwarder on the relay host, the attachment on a NATed callee), a byte sink for the relay
limit probes, and gasloc Exchangers for the exchange rows. The orchestrator drives it over stdin/stdout, one JSON
object per line (logs go to stderr):

    <- {"ready": {"peer_id": ..., "maddrs": [...]}}
    -> {"op": "reservation", "timeout_s": T}        wait until p2pd announces a /p2p-circuit address
    -> {"op": "connect", "peer": ID, "maddr": M, "fresh": F}   connect to ID at M (a circuit address forces the
                                                     relay; fresh: close existing connections to ID first)
    -> {"op": "conns", "peer": ID}                   the addresses of our connections to ID
    -> {"op": "push", "peer": ID, "nbytes": N, "chunk": C, "interval_s": S}   write to ID's sink until N or an error
    -> {"op": "sunk"}                                what our sink saw of the next (or last unread) stream
    -> {"op": "attach", "forwarder": ID, "timeout_s": T}   attach to a forwarder (gasloc forwarding)
    -> {"op": "prepare", "key": K, "specs": [[shape...], ...], "via": {peer: [forwarders]}}
    -> {"op": "arm", "key": K}  /  {"op": "go", "key": K, "peer": ID}  /  {"op": "wait", "key": K}
    -> {"op": "logs", "pattern": RE}                 p2pd log lines that match
    -> {"op": "exit"}
"""
from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import logging
import os
import re
import signal
import sys
import time

NS = "gnbench"
SINK = f"{NS}::sink"
# the p2pd log subsystems that say what a relay, a reservation and a hole punch did (the rest: errors only)
GOLOG = "error,relay=debug,autorelay=debug,p2p-circuit=debug,p2p-holepunch=debug,holepunch=debug,autonat=info"
MAX_LOG_LINES = 20000
log = logging.getLogger("nat_worker")


class Worker:
    def __init__(self, args):
        self.args = args
        self.p2p = self.routed = self.relay = None
        self.p2pd_lines: list[str] = []
        self.sunk: dict | None = None
        self.sink_done: asyncio.Event | None = None
        self.via: dict[str, list[str]] = {}
        self.exchangers: dict[str, dict] = {}

    async def setup(self) -> dict:
        from hivemind.p2p import P2P

        from gasloc.peer.swarm.forward import RelayService, RoutedP2P

        def keep(line: str) -> None:   # hivemind sends p2pd's output here; we keep it to read what p2pd did
            if len(self.p2pd_lines) < MAX_LOG_LINES:
                self.p2pd_lines.append(line)
        P2P._log_p2pd_message = staticmethod(keep)
        a = self.args
        if a.p2pd_flag:
            from gasloc.runtime.safeproc import add_p2pd_flags
            add_p2pd_flags(dict(f.split("=", 1) for f in a.p2pd_flag))
        kw = dict(host_maddrs=[f"/ip4/0.0.0.0/tcp/{a.port}"], initial_peers=a.initial_peer or None,
                  announce_maddrs=a.announce or None, use_auto_relay=a.auto_relay,
                  trusted_relays=a.trusted_relay or None, force_reachability=a.reachability)
        self.p2p = await P2P.create(**{k: v for k, v in kw.items() if v is not None})
        self.routed = RoutedP2P(self.p2p, NS, lambda peer: self.via.get(peer))
        self.relay = RelayService(self.routed, is_member=lambda pid: True, volunteer=a.forwarder,
                                  max_circuits=64, max_attached=16, circuit_timeout_s=600)
        await self.relay.start()
        self.sink_done = asyncio.Event()
        await self.p2p.add_binary_stream_handler(SINK, self._sink)
        return {"peer_id": str(self.p2p.peer_id), "maddrs": [str(m) for m in await self.p2p.get_visible_maddrs()]}

    async def shutdown(self) -> None:
        for st in self.exchangers.values():
            await st["ex"].stop()
        if self.relay is not None:
            await self.relay.stop()
        if self.p2p is not None:
            await self.p2p.shutdown()

    # ---- relays ----

    async def reservation(self, timeout_s: float) -> dict:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            circuit = [str(m) for m in await self.p2p.get_visible_maddrs(latest=True) if "p2p-circuit" in str(m)]
            if circuit:
                return {"seconds": time.monotonic() - t0, "maddrs": circuit}
            await asyncio.sleep(0.5)
        return {"seconds": None, "maddrs": []}

    async def connect(self, peer: str, maddr: str, fresh: bool = False) -> dict:
        """Connect to `peer` at `maddr`. p2pd returns at once when any connection to it exists (a relayed one
        too): `fresh` closes those first, so that the connection made is the one dialled at `maddr`."""
        from hivemind.p2p import PeerID
        t0 = time.monotonic()
        try:
            if fresh:
                await asyncio.wait_for(self.p2p._client.disconnect(PeerID.from_base58(peer)), 10)
            await asyncio.wait_for(self.p2p._client.connect(PeerID.from_base58(peer), [GoMaddr(maddr)]), 30)
        except Exception as e:  # noqa: BLE001 - reported to the orchestrator, which writes it into the table
            return {"ok": False, "error": f"{type(e).__name__}: {e}"}
        return {"ok": True, "seconds": time.monotonic() - t0, **await self.conns(peer)}

    async def conns(self, peer: str) -> dict:
        addrs = [str(a) for info in await self.p2p.list_peers() if str(info.peer_id) == peer for a in info.addrs]
        return {"addrs": addrs}

    async def _sink(self, info, reader, writer) -> None:
        got, t0, err = 0, time.monotonic(), ""
        try:
            while chunk := await reader.read(1 << 16):
                got += len(chunk)
        except Exception as e:  # noqa: BLE001 - what ended the stream is the measurement
            err = f"{type(e).__name__}: {e}"
        self.sunk = {"bytes": got, "seconds": time.monotonic() - t0, "error": err or "EOF"}
        self.sink_done.set()
        writer.close()

    async def push(self, peer: str, nbytes: int, chunk: int, interval_s: float) -> dict:
        """Write `nbytes` to `peer`'s sink in `chunk`s, `interval_s` apart; stop at the first error."""
        from hivemind.p2p import PeerID
        sent, t0, err = 0, time.monotonic(), ""
        writer = None
        try:
            _, _, writer = await asyncio.wait_for(
                self.p2p.call_binary_stream_handler(PeerID.from_base58(peer), SINK), 30)
            buf = os.urandom(chunk)
            while sent < nbytes:
                n = min(chunk, nbytes - sent)
                writer.write(buf[:n])
                await asyncio.wait_for(writer.drain(), 60)
                sent += n
                if interval_s:
                    await asyncio.sleep(interval_s)
            writer.write_eof()
            await asyncio.sleep(1.0)     # let the last bytes reach the sink before we close
        except Exception as e:  # noqa: BLE001 - the error that stopped us is the measurement
            err = f"{type(e).__name__}: {e}"
        finally:
            if writer is not None:
                writer.close()
        return {"written": sent, "seconds": time.monotonic() - t0, "error": err}

    async def sunk_report(self, timeout_s: float = 15.0) -> dict:
        try:
            await asyncio.wait_for(self.sink_done.wait(), timeout_s)
        except TimeoutError:
            return {"bytes": None, "error": f"no stream ended within {timeout_s:.0f} s"}
        report, self.sunk = self.sunk, None    # consumed: the next push's report is a new one
        self.sink_done.clear()
        return report

    # ---- gasloc forwarding ----

    async def attach(self, forwarder: str, timeout_s: float) -> dict:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            self.relay.keep_attached([forwarder], 1)
            if forwarder in self.relay.via:
                await asyncio.sleep(0.5)   # the reply came; the forwarder registered us before answering
                return {"seconds": time.monotonic() - t0}
            await asyncio.sleep(0.2)
        return {"seconds": None}

    # ---- exchanges: gasloc's Exchanger, as the peer runs it ----

    async def prepare(self, key: str, specs: list[list[int]], via: dict[str, list[str]]) -> dict:
        import torch

        from gasloc.peer.transport.exchange import ExchangeConfig, Exchanger
        self.via = dict(via)    # this row's routes only: a row before it may have routed the same peer otherwise
        g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
        own = [torch.randn(*s, generator=g) for s in specs]
        ex = Exchanger(ExchangeConfig(exchange_timeout_s=300, accept_timeout_s=30, codec="float32"), self.routed,
                       specs=[(tuple(s), torch.float32) for s in specs], fingerprint="bench",
                       is_member=lambda peer: True, namespace=f"{NS}{key}")
        await ex.start()
        self.exchangers[key] = {"ex": ex, "own": own}
        return {"ok": True}

    async def arm(self, key: str) -> dict:
        st = self.exchangers[key]
        await st["ex"].withdraw()
        st["ex"].offer(st["own"], round=1)
        st["pending"] = asyncio.ensure_future(st["ex"].wait_incoming(600))
        return {"ok": True}

    async def go(self, key: str, peer: str) -> dict:
        from hivemind.p2p import PeerID
        st = self.exchangers[key]
        await st["ex"].withdraw()
        st["ex"].offer(st["own"], round=1)
        t0 = time.perf_counter()
        res = await st["ex"].exchange(PeerID.from_base58(peer))
        seconds = time.perf_counter() - t0
        if res.ok:
            st["ex"].recycle(res.tensors)
        return {"ok": res.ok, "seconds": seconds, "path": self.routed.path.get(peer, "?"),
                "bytes_sent": res.bytes_sent, "bytes_received": res.bytes_received, "streams": res.streams,
                "detail": "" if res.ok else res.log_line()}

    async def wait(self, key: str) -> dict:
        st = self.exchangers[key]
        try:
            res = await asyncio.wait_for(st.pop("pending"), 30)
        except TimeoutError:
            return {"ok": False, "detail": "no incoming exchange"}
        if res is not None and res.ok:
            st["ex"].recycle(res.tensors)
        return {"ok": bool(res and res.ok), "detail": res.log_line() if res else "none"}

    async def drop(self, key: str) -> dict:
        st = self.exchangers.pop(key, None)
        if st:
            await st["ex"].stop()
        return {"ok": True}

    async def logs(self, pattern: str) -> dict:
        rx = re.compile(pattern)
        return {"lines": [line for line in self.p2pd_lines if rx.search(line)][-200:]}


P2P_CODE, CIRCUIT_CODE = 421, 290     # multiaddr protocol codes of /p2p/<id> and /p2p-circuit


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


class GoMaddr:
    """A multiaddr in the binary form p2pd (go-multiaddr) parses. The Python multiaddr that hivemind bundles writes
    the value of /p2p/<id> as a CID (0x01 0x72 ... before the multihash); go-multiaddr expects the bare multihash
    and rejects the address ("length greater than remaining number of bytes in buffer"), so a circuit address
    (/ip4/../tcp/../p2p/<relay>/p2p-circuit) is encoded here by hand. p2pclient's connect calls only to_bytes()."""

    def __init__(self, text: str):
        self.text = text

    def to_bytes(self) -> bytes:
        from hivemind.p2p import PeerID
        from hivemind.utils.multiaddr import Multiaddr
        out, rest = b"", self.text
        while rest:
            if rest.startswith("/p2p-circuit"):
                out, rest = out + _varint(CIRCUIT_CODE), rest[len("/p2p-circuit"):]
            elif rest.startswith("/p2p/"):
                pid, _, tail = rest[len("/p2p/"):].partition("/")
                mh = PeerID.from_base58(pid).to_bytes()
                out, rest = out + _varint(P2P_CODE) + _varint(len(mh)) + mh, "/" + tail if tail else ""
            else:
                cut = min((i for i in (rest.find("/p2p/"), rest.find("/p2p-circuit")) if i > 0), default=len(rest))
                out, rest = out + Multiaddr(rest[:cut]).to_bytes(), rest[cut:]
        return out


async def main(args) -> None:
    worker = Worker(args)

    def reply(obj) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    try:
        reply({"ready": await worker.setup()})
        while line := await asyncio.to_thread(sys.stdin.readline):
            cmd = json.loads(line)
            op = cmd.pop("op")
            if op == "exit":
                break
            if op == "sunk":
                op = "sunk_report"
            try:
                reply(await getattr(worker, op)(**cmd))
            except Exception as e:  # noqa: BLE001 - one failed command is reported, the worker stays up
                log.exception("op %s failed", op)
                reply({"error": f"{type(e).__name__}: {e}"})
    finally:
        await worker.shutdown()


if __name__ == "__main__":
    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)    # PR_SET_PDEATHSIG: die with the orchestrator
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--initial-peer", action="append", default=[])
    p.add_argument("--announce", action="append", default=[])
    p.add_argument("--trusted-relay", action="append", default=[])
    p.add_argument("--auto-relay", action="store_true")
    p.add_argument("--reachability", choices=["public", "private"])
    p.add_argument("--forwarder", action="store_true", help="volunteer as a gasloc forwarder")
    p.add_argument("--p2pd-flag", action="append", default=[], help="NAME=VALUE, an extra p2pd flag")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    os.environ.setdefault("GOLOG_LOG_LEVEL", GOLOG)
    asyncio.run(main(p.parse_args()))
