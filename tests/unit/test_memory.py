"""peer/train/memory.py: the partner's batch check without a copy of our parameters, the dry run's measured peak
in parameter copies, the refusal line and what it suggests, and the out-of-memory marker that stops a crash
loop."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from gasloc.peer.config import PeerConfig
from gasloc.peer.train.data import evaluate
from gasloc.peer.train.memory import (
    DoesNotFit,
    Fit,
    Headroom,
    RoundPeak,
    _refusal,
    check_fit,
    dry_run,
    estimate_bytes,
    evaluate_with,
    is_out_of_memory,
    num_params,
    oom_refusal,
    outgoing_specs,
    suggestion,
    write_oom_marker,
)
from gasloc.peer.train.model import ModelConfig, build_model
from gasloc.peer.train.outer import OuterConfig, make_outer
from gasloc.peer.transport.staging import Staging


def cfg_of(**over) -> PeerConfig:
    tree = {"model": {"preset": "small", "seq_len": 32}, "data": {"batch_size": 2}}
    for k, v in over.items():
        sec, key = k.split("__")
        tree.setdefault(sec, {})[key] = v
    return PeerConfig.model_validate(tree)


def test_evaluate_with_gives_the_loss_at_the_point_and_leaves_our_parameters_alone():
    model = build_model(ModelConfig(seq_len=16), 256)  # tiny, tied embeddings: one tensor for two names
    own = [p.detach().clone() for p in model.parameters()]
    ptrs = [p.data_ptr() for p in model.parameters()]
    point = [p.detach() + 0.02 * torch.randn_like(p) for p in model.parameters()]
    batches = [torch.randint(0, 256, (2, 17)) for _ in range(2)]
    got = evaluate_with(model, point, batches)
    assert all(torch.equal(p, o) for p, o in zip(model.parameters(), own))
    assert [p.data_ptr() for p in model.parameters()] == ptrs
    with torch.no_grad():
        for p, t in zip(model.parameters(), point):
            p.copy_(t)
    assert got == pytest.approx(evaluate(model, batches), rel=1e-6)
    with pytest.raises(ValueError):
        evaluate_with(model, point[:-1], batches)


def test_outgoing_specs_match_what_outgoing_returns():
    params = list(build_model(ModelConfig(preset="micro", seq_len=16), 256).parameters())
    for algorithm in ("gasloc", "gossip", "diloco", "noloco", "local"):
        oc = OuterConfig(algorithm=algorithm)
        sent = make_outer(oc, params).outgoing(params)
        assert outgoing_specs(oc, params) == [(tuple(t.shape), t.dtype) for t in sent], algorithm


def test_out_of_memory_errors_are_recognised():
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert is_out_of_memory(MemoryError())
    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))


@pytest.mark.skipif(not RoundPeak(torch.device("cpu")).resettable, reason="needs Linux's resettable VmHWM")
def test_the_dry_run_measures_a_round_in_a_handful_of_parameter_copies():
    """small (5.2M parameters): the dry run's peak above the runtime, in copies of the parameters, is between the
    six of the inner phase and the outer step's estimate plus activations (the bench measures it precisely)."""
    cfg = cfg_of()
    n4 = 4 * num_params(cfg.model, 256)
    dry_run(cfg, 256, torch.device("cpu"), Staging)  # first one: the runtime's one-time allocations
    copies = dry_run(cfg, 256, torch.device("cpu"), Staging) / n4
    assert 5 <= copies <= estimate_bytes(cfg.model, 256, 2, False) / n4 + 2, copies


def test_a_config_that_does_not_fit_is_refused_in_one_line_naming_what_fits():
    cfg = cfg_of(model__preset="medium", data__batch_size=8)
    need = estimate_bytes(cfg.model, 256, 8, False)
    room = Headroom(int(0.5 * need), "under run.memory_limit_mb=123")
    line = _refusal(cfg, 256, False, Fit(need, room, measured=True), scale=1.0)
    assert "\n" not in line and "model.preset='medium'" in line and "measured" in line
    assert "run.memory_limit_mb=123" in line and "model.preset='small' fits" in line, line
    # a smaller batch is named first when the batch is what does not fit
    big_batch = cfg_of(model__preset="tiny", model__seq_len=512, data__batch_size=64)
    need = estimate_bytes(big_batch.model, 256, 64, False)
    got = suggestion(big_batch, 256, False, int(0.6 * need), 1.0)
    assert got.startswith("data.batch_size="), got
    assert suggestion(cfg, 256, False, 1000, 1.0).startswith("no preset fits")


def test_check_fit_refuses_under_a_tight_limit_and_passes_under_a_loose_one():
    with pytest.raises(DoesNotFit, match="memory_limit_mb=1"):
        check_fit(cfg_of(run__memory_limit_mb=1), 256, torch.device("cpu"))
    fit = check_fit(cfg_of(model__preset="micro", run__memory_limit_mb=1e6), 256, torch.device("cpu"))
    assert fit.ok and fit.need_bytes > 0


def test_the_out_of_memory_marker_holds_for_the_same_settings_only(tmp_path):
    cfg = cfg_of()
    assert oom_refusal(tmp_path, cfg, torch.device("cpu")) is None
    write_oom_marker(tmp_path, cfg, torch.device("cpu"), 7, torch.OutOfMemoryError("CUDA out of memory.\nmore"))
    line = oom_refusal(tmp_path, cfg, torch.device("cpu"))
    assert line is not None and "round 7" in line and "CUDA out of memory." in line and "\n" not in line
    assert oom_refusal(tmp_path, cfg_of(data__batch_size=1), torch.device("cpu")) is None  # settings changed
    assert not (tmp_path / "out-of-memory.json").exists()


def test_doctor_uses_the_same_estimate_and_names_what_fits(tmp_path):
    from gasloc.cli.doctor_checks import check_memory

    cfg = tmp_path / "peer.toml"
    cfg.write_text('[model]\npreset = "medium"\n[run]\ndevice = "cpu"\nmemory_limit_mb = 500\n')
    c = check_memory(cfg)
    assert c.status == "FAIL" and "model.preset 'medium'" in c.detail and "run.memory_limit_mb=500" in c.detail
    assert "fits" in c.fix
    need = estimate_bytes(cfg_of(model__preset="medium", model__seq_len=128, data__batch_size=8).model, 256, 8,
                          False)
    assert f"{need / 1e6:.0f} MB" in c.detail
    cfg.write_text('[model]\npreset = "micro"\n[run]\ndevice = "cpu"\n')
    assert check_memory(cfg).status == "OK"


FREED_BIG_TENSORS = textwrap.dedent("""
    import sys, torch
    from gasloc.peer.train.memory import compact_host_heap
    def rss():
        return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS:")) * 1024
    if sys.argv[1] == "compact":
        assert compact_host_heap()
    first = torch.empty(1 << 18); del first        # glibc raises its mmap threshold past 1 MB on this free
    big, small = [], []
    for _ in range(200):                             # 200 MB of 1-MB tensors (gradients, exchange buffers) between
        big.append(torch.ones(1 << 18))              # small ones that stay (activations, Python's objects)
        small.append(torch.ones(1 << 14))
    before = rss()
    del big
    print((before - rss()) / 1e6)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and /proc are Linux's")
def test_a_cpu_peers_freed_large_tensors_go_back_to_the_kernel():
    """compact_host_heap (a CPU peer with run.compact_host_heap): tensors that one phase frees leave the resident set
    at once, instead of staying in glibc's heap, where another phase's tensors of other sizes would not fit."""
    out = subprocess.run([sys.executable, "-c", FREED_BIG_TENSORS, "compact"], capture_output=True, text=True,
                         timeout=120, check=True)
    assert float(out.stdout) > 150, out.stdout  # of 200 MB freed


def test_staging_release_drops_every_kept_buffer_and_the_next_exchange_allocates_afresh():
    """A CPU peer's exchange drops its buffers after each search (peer/swarm/gossip.py keep_buffers=False): none
    stays referenced by the Staging, and the next encode and decode work as before."""
    from gasloc.protocol.codec import parse
    from gasloc.protocol.messages import TensorSpec

    ts = [torch.randn(64, 64), torch.randn(300)]
    codec = parse("int8")
    st = Staging([TensorSpec.of(tuple(t.shape), t.dtype) for t in ts], codec)

    def exchange():
        payload = st.encode(ts)
        own = st.own_wire(payload, ts)
        bufs, out = st.receive_buffers(codec)
        for b, p in zip(bufs, payload):
            b.copy_(p)
        assert st.decode(codec, bufs, out, None, None) == []
        assert all(torch.equal(a, b) for a, b in zip(out, own))  # what the partner decodes of our payload
        return payload, own, out

    _, own, out = exchange()
    st.recycle(out)
    kept = [*st._send, *st._own, *st._spare, *st._recv[codec.name]]
    st.release()
    assert st._send is None and st._own is None and st._spare is None and not st._recv
    _, own2, out2 = exchange()
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(own2, own))
    assert all(torch.allclose(a, t, atol=0.05) for a, t in zip(own2, ts))
    del kept


@pytest.mark.parametrize("codec", ["mod4-sd", "int8-p10", "float32"])
def test_the_dry_run_exchanges_through_every_kind_of_codec(codec):
    """The start-up dry run sends and decodes through the exchange's own staging, also with a codec that needs the
    exchange's seed or its probes (a modulo codec decodes against our own tensors and codes)."""
    cfg = cfg_of(model__preset="micro", exchange__codec=codec)
    calls = []

    class Recording(Staging):
        def encode(self, *a, **kw):
            calls.append(("encode", self.codec.name))
            return super().encode(*a, **kw)

        def decode(self, codec, *a, **kw):
            calls.append(("decode", codec.name))
            return super().decode(codec, *a, **kw)

    # the peak itself is not asserted: a micro round's few hundred KB can land in pages the process already holds
    assert dry_run(cfg, 256, torch.device("cpu"), Recording) >= 0
    # a modulo peer also runs the exchange it has with a partner of another codec: int8 out, the partner's in
    fallback = [("encode", "int8"), ("decode", "float32")] if codec.startswith("mod") else []
    assert calls == [("encode", codec), ("decode", codec), *fallback]


def test_a_pipelined_exchange_encodes_and_decodes_the_same_bytes_tensor_by_tensor():
    """exchange.py `_pipelined` sends tensor k as soon as `encode_one` wrote it and decodes each of theirs with
    `decode_one`: the same payload and the same decoded tensors as the whole-payload `encode` and `decode`."""
    from gasloc.protocol.codec import parse
    from gasloc.protocol.messages import TensorSpec

    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(64, 64, generator=g), torch.randn(300, generator=g)]
    partner = [t + 0.01 * torch.randn(t.shape, generator=g) for t in ts]
    codec, seed, steps = parse("mod4-sd"), 1234, [0.004, 0.006]
    specs = [TensorSpec.of(tuple(t.shape), t.dtype) for t in ts]
    st, other = Staging(specs, codec), Staging(specs, codec)
    whole = [p.clone() for p in st.encode(ts, seed, steps)]
    theirs = [p.clone() for p in other.encode(partner, seed, steps)]
    one = [st.encode_one(k, t, seed, steps[k]).clone() for k, t in enumerate(ts)]
    assert all(torch.equal(a, b) for a, b in zip(whole, one))
    bufs, out = st.receive_buffers(codec)
    for b, p in zip(bufs, theirs):
        b.copy_(p)
    assert st.decode(codec, bufs, out, seed, ts, whole, steps) == []
    want = [o.clone() for o in out]
    assert all(st.decode_one(codec, bufs[k], out[k], seed, ts[k], one[k], steps[k]) for k in range(2))
    assert all(torch.equal(a, b) for a, b in zip(out, want))
    nan = torch.full((3,), float("nan"))     # a lossless wire's buffer is the tensor itself: checked as it came
    assert not st.decode_one(parse("float32"), nan, nan, None, None, None, None)
