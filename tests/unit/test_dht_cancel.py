"""A DHT store or get of ours ends cancelled when it is cancelled, whatever moment the cancel lands on.

Python 3.11's `asyncio.wait_for` returns the inner result, and drops a cancel of the waiting task, when that cancel
arrives after the inner call finished but before the task resumed (tests/unit/test_forward_cancel.py has the same
for the forwarder's attachments). Announcing and listing await these calls under `asyncio.gather`, which raises
the cancel all the same; a task that awaits one directly (the single-key check at start) went on as if it had not
been cancelled. No DHT here: a stand-in whose store and get return futures we resolve."""
import asyncio

import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.crypto import RSAPrivateKey

from gasloc.peer.swarm.membership import BucketReader, Membership, peer_id_of

SIGNER = RSASignatureValidator(RSAPrivateKey())


class FakeDHT:
    """store() and get() hand out futures; the test resolves them."""

    def __init__(self):
        self.pending: list[asyncio.Future] = []

    def _future(self):
        self.pending.append(asyncio.get_running_loop().create_future())
        return self.pending[-1]

    def store(self, *_args, **_kwargs):
        return self._future()

    def get(self, *_args, **_kwargs):
        return self._future()


async def _cancel_after_reply(call, dht: FakeDHT, reply, steps: int) -> asyncio.Task | None:
    """The task of `call`, cancelled `steps` loop steps after its answer came; None when it had already returned
    by then (nothing to cancel at that step)."""
    task = asyncio.create_task(call())
    while not dht.pending:          # the call is out; the task waits for its answer
        await asyncio.sleep(0)
    dht.pending[0].set_result(reply)
    for _ in range(steps):          # the answer is taken for some of these steps, then the cancel comes
        await asyncio.sleep(0)
    if not task.cancel():
        return None
    await asyncio.wait({task}, timeout=2)
    return task


@pytest.mark.parametrize("steps", range(3))
def test_a_store_cancelled_just_after_its_answer_ends_cancelled(steps):
    async def main():
        dht = FakeDHT()
        m = Membership(dht, SIGNER, run_id="r", peer_id=peer_id_of(SIGNER.local_public_key), fingerprint="f",
                       protocol=1, ttl_s=15.0, request_timeout_s=5.0)
        task = await _cancel_after_reply(lambda: m._store("r_m0_0", None, 1e12), dht, True, steps)
        assert task is None or task.done() and task.cancelled(), (steps, task)
    asyncio.run(main())


@pytest.mark.parametrize("steps", range(3))
def test_a_get_cancelled_just_after_its_answer_ends_cancelled(steps):
    async def main():
        dht = FakeDHT()
        reader = BucketReader(dht, run_id="r", request_timeout_s=5.0, beam=3)
        task = await _cancel_after_reply(lambda: reader._get("r_m0_0"), dht, None, steps)
        assert task is None or task.done() and task.cancelled(), (steps, task)
    asyncio.run(main())
