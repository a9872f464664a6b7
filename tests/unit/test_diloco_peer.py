"""The live DiLoCo peer's side of one model (peer/daemon.py, peer/swarm/diloco.py): a download takes the donor's
momentum with its anchor (else the peer's next steps part from its group's), a donor serves the state of its last
step, the all-reduce's codec follows the exchange's, and a peer still looking for a group downloads once the swarm has
stepped past its epoch."""
from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time

import pytest
import torch
from hivemind.averaging.control import AveragingStage

from gasloc.peer.config import PeerConfig
from gasloc.peer.daemon import Peer
from gasloc.peer.swarm.diloco import compression_name
from gasloc.peer.train.data import build_data
from gasloc.peer.train.model import build_model
from gasloc.peer.train.outer import make_outer
from gasloc.protocol.guard import DistanceHistory, FarStreak

pytestmark = pytest.mark.timeout(120)


class _Net:
    live: dict = {}  # the listing: no records (no listed rounds to compare)
    def __init__(self, donor, rnd, params, outer):
        self.state = (donor, rnd, params, outer)

    def download_state(self, params, outer, exclude=(), first=(), trust=None, stop=None):
        self.first = tuple(first)
        donor, rnd, state, outer_state = self.state
        if donor in exclude:
            return None
        return donor, {"round": rnd, "num_outer": len(outer_state), "peer_id": donor,
                       "outer_tensors": [t.clone() for t in outer_state]}, [t.clone() for t in state]

    def believed_rounds(self):
        return {self.state[0]: self.state[1]}

    def round_caps(self):   # the highest round we believe the donor can have reached: its own, here
        return {self.state[0]: self.state[1]}

    def refresh_listing(self):
        pass

    def announce(self, wait=False):
        pass

    def round_boundary(self, take):
        self.served = take()


def _peer(algorithm: str) -> Peer:
    cfg = PeerConfig.model_validate({"model": {"preset": "tiny", "seq_len": 32}, "data": {"batch_size": 4},
                                     "outer": {"algorithm": algorithm}, "swarm": {"join_cross_check": False}})
    p = Peer.__new__(Peer)
    p.cfg, p.device, p.round, p.peer_id = cfg, torch.device("cpu"), 0, "me"
    p.data, tok = build_data(cfg.data, cfg.model.seq_len)
    p.val_batches = p.data.val_batches()
    p.model = build_model(cfg.model, tok.vocab_size, seed=0)
    p.params = list(p.model.parameters())
    p.outer = make_outer(cfg.outer, p.params)
    p.guard, p._far = DistanceHistory(cfg.guard), FarStreak(2)
    p.averaging, p.stopping = None, threading.Event()
    return p


def _moved(p: Peer, by: float) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [t.detach() + by * t.detach().abs().mean() * torch.randn(t.shape, generator=g) for t in p.params]


def test_a_diloco_download_takes_the_donors_momentum_and_the_others_reset_theirs():
    d = _peer("diloco")
    state, buf = _moved(d, 0.01), [torch.full_like(t, 0.5) for t in d.params]
    d.net = _Net("QmA", 7, state, buf)
    assert d._adopt_swarm_state() == "QmA" and d.round == 7
    assert all(torch.equal(a, b) for a, b in zip(d.outer.anchor, state))
    assert all(torch.equal(a, b) for a, b in zip(d.outer.buf, buf))
    # gasloc: the donor's outer state is never adopted (protocol/claims.py threat model)
    g = _peer("gasloc")
    z = [t + 5.0 for t in _moved(g, 0.01)]
    g.net = _Net("QmA", 7, _moved(g, 0.01), z)
    assert g._adopt_swarm_state() == "QmA"
    assert all(torch.equal(a, b) for a, b in zip(g.outer.z_prev, g.params))


def test_a_fork_downloads_from_the_members_that_hold_its_groups_model():
    """A round that ended FORKED (protocol/epochs.py) names the groupmates holding the group's model; the catch-up at
    the round's end asks them first, and takes their anchor, momentum and epoch."""
    from gasloc.peer.metrics import NullSink
    d = _peer("diloco")
    state, buf = _moved(d, 0.01), [torch.full_like(t, 0.5) for t in d.params]
    d.net = _Net("QmHolder", 9, state, buf)
    d._pending, d.sink, d.state = None, NullSink(), "training"
    d._catch_up, d._donors_first = "behind", ("QmHolder", "QmOther")
    d._catch_up_if_due()
    assert d.net.first == ("QmHolder", "QmOther") and d.round == 9
    assert all(torch.equal(a, b) for a, b in zip(d.outer.anchor, state))
    assert d._donors_first == () and d._catch_up is None  # one catch-up per verdict


def test_a_waiting_diloco_peer_serves_the_state_of_its_last_step_not_its_moved_params():
    d = _peer("diloco")
    d.round = 4
    d.outer.buf = [torch.full_like(t, 0.25) for t in d.params]
    with torch.no_grad():  # inner steps moved the params since the last outer step
        for p in d.params:
            p.add_(1.0)
    meta, tensors = d._anchor_snapshot()
    n = len(d.params)
    assert meta["round"] == 4 and meta["num_outer"] == n and len(tensors) == 2 * n  # the momentum, per parameter
    assert all(torch.equal(a, t) for a, t in zip(d.outer.anchor, tensors[:n]))
    assert all(torch.equal(b, t) for b, t in zip(d.outer.buf, tensors[n:]))
    assert d.snapshot()[0]["num_outer"] == n  # at a round boundary too


@pytest.mark.parametrize("codec,compression", [("float32", "none"), ("float16", "float16"), ("bfloat16", "float16"),
                                               ("int8", "float16"), ("int4", "float16")])
def test_the_all_reduce_codec_follows_the_exchange(codec, compression):
    cfg = PeerConfig.model_validate({"outer": {"algorithm": "diloco"}, "exchange": {"codec": codec}})
    assert compression_name(cfg) == compression
    pinned = PeerConfig.model_validate({"outer": {"algorithm": "diloco"}, "exchange": {"codec": codec},
                                        "diloco": {"compression": "none"}})
    assert compression_name(pinned) == "none"


def test_gasloc_swarm_sets_the_start_barrier_to_its_peers_unless_the_caller_chose_one(tmp_path):
    from gasloc.cli.swarm import _sets_initial_group
    chosen, other, broken = tmp_path / "a.toml", tmp_path / "b.toml", tmp_path / "c.toml"
    chosen.write_text("[diloco]\ninitial_group_size = 3\n")
    other.write_text("[inner]\nlr = 0.001\n")
    broken.write_text("[[[")
    assert not _sets_initial_group({}, None) and not _sets_initial_group({}, other)
    assert _sets_initial_group({"GASLOC_DILOCO__INITIAL_GROUP_SIZE": "2"}, None) and _sets_initial_group({}, chosen)
    assert _sets_initial_group({}, broken)  # the peers report the file's problem themselves


class _Looking:
    """hivemind's StepControl of a step that never finds a group."""
    stage = AveragingStage.LOOKING_FOR_GROUP
    cancelled = False

    def result(self, timeout):
        time.sleep(timeout)
        raise concurrent.futures.TimeoutError

    def cancel(self):
        self.cancelled = True


class _Averager:
    def __init__(self):
        self.control = _Looking()

    @contextlib.contextmanager
    def get_tensors(self):
        yield [torch.zeros(2)]

    def set_group(self, *args):
        pass

    def step(self, **kwargs):
        return self.control


def test_a_diloco_peer_looking_for_a_group_downloads_once_the_swarm_steps_past_its_epoch():
    """Frozen mid-attempt, or joined with a state a round old: the peers of our epoch have stepped on, nobody is
    left to come. The attempt is given up at the next look at the listing (BEHIND_CHECK_S), not at its deadline
    (averaging_timeout_s, 60 s by default), and the round ends behind: the daemon downloads the swarm's state."""
    from gasloc.peer.swarm import diloco

    cfg = PeerConfig.model_validate({"outer": {"algorithm": "diloco"}, "diloco": {"averaging_timeout_s": 10.0}})
    listed = {"QmA": 7, "QmB": 7}
    avg = diloco.DilocoAveraging.__new__(diloco.DilocoAveraging)
    avg.cfg, avg.stopping, avg.set_state, avg.serve = cfg, threading.Event(), lambda s: None, lambda: None
    avg.net = type("Net", (), {"peer_id": "me", "believed_rounds": lambda self: dict(listed)})()
    avg.anchor, avg.stride, avg.averager, avg.last_group = lambda: [torch.zeros(2)], 1, _Averager(), 2
    avg.key_base, avg.compression, avg.vector_bytes = "k", "none", 8
    threading.Timer(1.5, lambda: listed.update(QmA=8, QmB=8)).start()  # the others step without us
    t0 = time.monotonic()
    ex = avg.average([torch.ones(2)], 7, live_count=lambda: 2)
    took = time.monotonic() - t0
    assert ex.outcome == "behind" and "while we looked for a group" in ex.detail, ex
    assert avg.averager.control.cancelled
    assert 1.5 <= took < cfg.diloco.averaging_timeout_s, took  # before the attempt's deadline
