"""DiLoCo's all-reduce is used only when every member's part reached everyone (peer/swarm/diloco.py
allreduce_shortfall): hivemind 1.1.12 reports a step whose groupmate failed mid-way as a success, with the failed
share of each member's vector left at that member's own values, so the members' "means" differ and one model
becomes several."""
from __future__ import annotations

import asyncio

import pytest
import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.partition import TensorPartContainer, TensorPartReducer
from hivemind.compression import NoCompression

from gasloc.peer.swarm.diloco import SafeAverager, allreduce_shortfall
from gasloc.runtime.safeproc import SafeDHT

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def _reduce(senders: int = 2, ban: str | None = None) -> TensorPartReducer:
    """A reducer of 2 parts, run to the end; the last sender is banned (hivemind's on_sender_failed) "before_last"
    (after sending its first part) or "after_last" (after sending both), or never."""
    async def run() -> TensorPartReducer:
        reducer = TensorPartReducer([torch.Size([4]), torch.Size([4])], num_senders=senders)
        await asyncio.gather(*(reducer.accumulate_part(s, 0, torch.ones(4)) for s in range(senders)))
        if ban == "before_last":
            reducer.on_sender_failed(senders - 1)
        sending = range(senders - 1) if ban == "before_last" else range(senders)
        await asyncio.gather(*(reducer.accumulate_part(s, 1, torch.ones(4)) for s in sending))
        if ban == "after_last":
            reducer.on_sender_failed(senders - 1)
        assert reducer.finished.is_set()
        return reducer
    return asyncio.run(run())


def _container(failed_reducer: int | None = None) -> TensorPartContainer:
    """Our vector split between 2 reducers, every part's result back, except from `failed_reducer` (hivemind's
    register_failed_reducer: our own values stay)."""
    async def run() -> TensorPartContainer:
        c = TensorPartContainer([torch.zeros(8)], peer_fractions=[0.5, 0.5], part_size_bytes=16)  # 4 values a part
        for peer in range(2):
            if peer == failed_reducer:
                c.register_failed_reducer(peer)
            else:
                for i in range(c.num_parts_by_peer[peer]):
                    c.register_processed_part(peer, i, torch.zeros(4))
        return c
    return asyncio.run(run())


def test_a_complete_all_reduce_has_no_shortfall():
    assert allreduce_shortfall(_container(), _reduce()) is None
    # a sender that failed after its last part was averaged in full
    assert allreduce_shortfall(_container(), _reduce(ban="after_last")) is None
    # of three, one left out of a part: the part is the other two's mean, the same one every complete member holds
    assert allreduce_shortfall(_container(), _reduce(senders=3, ban="before_last")) is None


def test_a_reducer_that_never_answered_or_a_part_averaged_alone_is_a_shortfall():
    why = allreduce_shortfall(_container(failed_reducer=1), _reduce())
    assert why is not None and "4 of 8 values came back from no reducer" in why, why
    why = allreduce_shortfall(_container(), _reduce(ban="before_last"))   # of two: the second part is ours alone
    assert why is not None and "1 of 2 parts we averaged had no sender but us" in why, why


@pytest.mark.timeout(120)
def test_a_groupmate_that_fails_mid_all_reduce_fails_the_step_for_both(monkeypatch):
    """Two real averagers; B never sends its share to A and never hears back from A (a stalled link). Unpatched
    hivemind finishes both steps "successfully" with different results (A's share of B left at B's own values, A
    averaging its share without B); here both steps fail, so neither member applies a mean the other does not hold."""
    dhts, averagers = [], []
    try:
        dhts.append(SafeDHT(start=True, host_maddrs=LOOPBACK))
        dhts.append(SafeDHT(start=True, host_maddrs=LOOPBACK, initial_peers=dhts[0].get_visible_maddrs()))
        victim = str(dhts[1].peer_id)
        real = AllReduceRunner._communicate_with_peer

        async def stalled(self, peer_id):
            if str(self.peer_id) == victim and peer_id != self.peer_id:
                # what hivemind does when the reducer's stream fails: our share of that part stays ours
                self.tensor_part_container.register_failed_reducer(self.ordered_peer_ids.index(peer_id))
                return
            await real(self, peer_id)

        # patched before the averagers fork: both processes carry it, only B's peer id takes the stalled path
        monkeypatch.setattr(AllReduceRunner, "_communicate_with_peer", stalled)
        # two of hivemind's parts (2**19 bytes each), so each averager reduces one whichever order the group has
        # (with one part, the member that reduces it all may be the stalled one: then nothing is partial)
        values = [torch.full((2 * 2**17,), 1.0), torch.full((2 * 2**17,), 3.0)]
        for dht, v in zip(dhts, values):
            averagers.append(SafeAverager([v.clone()], dht, start=True, prefix="shortfall", target_group_size=2,
                                          min_group_size=2, min_matchmaking_time=2.0, request_timeout=1.0,
                                          allreduce_timeout=20.0, next_chunk_timeout=1.0, shutdown_timeout=5,
                                          compression=NoCompression()))
        controls = [a.step(wait=False, allow_retries=False, timeout=30) for a in averagers]
        outcomes = []
        for control in controls:
            try:
                control.result(timeout=40)
                outcomes.append(None)
            except Exception as e:  # noqa: BLE001 - hivemind hands the step's exception over as is
                outcomes.append(str(e))
        results = []
        for a in averagers:
            with a.get_tensors() as (t,):
                results.append(t.clone())
        assert all(o is not None and "partial all-reduce" in o for o in outcomes), (
            outcomes, [float(r.mean()) for r in results])
    finally:
        for a in averagers:
            a.shutdown()
        for d in dhts:
            d.shutdown()


def test_a_follower_whose_target_is_below_its_group_keeps_the_group():
    """Views of the listing differ (a peer just resumed or joined sees fewer peers): a leader that targets 4 takes a
    follower that targets 3. hivemind's key manager, after the group formed, draws group_size numbers out of
    range(its target_group_size); with the follower's target there it raised ValueError and failed the all-reduce
    for all four (the e2e DiLoCo test's freeze-and-join phase timed out on it on CI). Real hivemind objects, our
    _set_group in between."""
    from types import SimpleNamespace

    from hivemind.averaging.group_info import GroupInfo
    from hivemind.averaging.key_manager import GroupKeyManager
    from hivemind.averaging.matchmaking import PotentialLeaders
    from hivemind.p2p import PeerID

    peers = tuple(PeerID(bytes([i]) * 34) for i in range(4))
    keys = GroupKeyManager(SimpleNamespace(peer_id=peers[2]), "run_diloco_fp", "", target_group_size=2)
    mm = SimpleNamespace(group_key_manager=keys, potential_leaders=PotentialLeaders(peers[2], 2.0, 2),
                         target_group_size=2, min_group_size=2)
    averager = SimpleNamespace(_matchmaking=mm)
    asyncio.run(SafeAverager._set_group(averager, "run_diloco_fp_e7", 3, 2))
    assert (mm.target_group_size, mm.potential_leaders.target_group_size, mm.min_group_size) == (3, 3, 2)
    assert keys.current_key == "run_diloco_fp_e7.0b"
    for group_id in (b"a", b"b", b"c"):
        asyncio.run(keys.update_key_on_group_assembled(GroupInfo(group_id, peers, gathered=(b"",) * 4)))
    assert keys.current_key == "run_diloco_fp_e7.0b"  # no group bits: the epoch alone keys the group
