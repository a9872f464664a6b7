"""A NATed peer's attachment ends when it is cancelled, whatever moment the cancel lands on (peer/swarm/forward.py).

Python 3.11's `asyncio.wait_for` returns the inner result, and drops a cancel of the waiting task, when that
cancel arrives after the inner call finished but before the task resumed. `detach_all` (we learnt we are
reachable) cancels each attachment task: landing in that gap during the attach handshake, the cancel was lost and
the attachment went on holding its stream, out of `attachments`, where nothing would end it (a CI run of
tests/integration/test_forward.py timed out waiting for it). No p2pd here: a stand-in stream whose reply we feed."""
import asyncio

import pytest

from gasloc.peer.swarm.forward import RelayService, RoutedP2P, _reply
from gasloc.protocol.codes import Code
from gasloc.protocol.wire import encode_header

FORWARDER = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


class Writer:
    def __init__(self):
        self.closed = False

    def write(self, _data):
        pass

    async def drain(self):
        pass

    def close(self):
        self.closed = True


class FakeP2P:
    """Opens one stream per call: a reader we feed, a writer that records its close."""

    def __init__(self):
        self.streams: list[tuple[asyncio.StreamReader, Writer]] = []

    async def call_binary_stream_handler(self, _peer, _name):
        self.streams.append((asyncio.StreamReader(), Writer()))
        return (None, *self.streams[-1])


@pytest.mark.parametrize("steps", range(8))
def test_detach_all_ends_an_attachment_whose_reply_just_arrived(steps):
    async def main():
        p2p, ended = FakeP2P(), []
        service = RelayService(RoutedP2P(p2p, "ns", lambda peer: None), is_member=lambda _: True, volunteer=False,
                               max_circuits=1, max_attached=1, circuit_timeout_s=5,
                               on_detached=lambda: ended.append(1))
        service.keep_attached([FORWARDER], want=1)
        task = service.attachments[FORWARDER]
        while not p2p.streams:                 # the attach request is out; the task waits for the reply
            await asyncio.sleep(0)
        for _ in range(3):
            await asyncio.sleep(0)
        reader, writer = p2p.streams[0]
        reader.feed_data(encode_header(_reply(Code.OK)))
        for _ in range(steps):                 # the reply is read for some of these steps, then the cancel comes
            await asyncio.sleep(0)
        service.detach_all()
        await asyncio.wait({task}, timeout=2)
        assert task.done() and writer.closed and ended == [1], (steps, task, writer.closed, ended)
    asyncio.run(main())
