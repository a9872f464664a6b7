"""Memory of a training peer: what a round needs at its peak, whether that fits before the peer joins a swarm, and
what it used in each round.

A round's peak, in fp32 copies of the parameters (n of them, 4n bytes each; docs/gpu.md has the measurement):
- the inner phase: the model, its gradients, AdamW's two moments, the outer anchor and z_prev (GASLoC form C) = 6,
  plus activations;
- the outer step: the model (in a plain round it holds y, what we send: outer.outgoing in_place), two moments,
  anchor, z_prev (the gradients are freed when the phase ends) = 5, plus the exchange's buffers (received tensors,
  with a lossy codec our own wire form and the two payloads: 2.5 with int8; a modulo codec's peer also holds,
  with a partner of another codec, an int8 payload and its decoded copy besides its own send buffers), which a CPU
  peer drops after each search so that the inner phase reuses them.

Fit check (`check_fit`): an analytic estimate first (so a preset far too large is refused without trying it), then
one dry inner and outer step on a throwaway model (same code as a round) whose measured peak is compared with the
headroom: on CUDA the device's free memory (torch.cuda.mem_get_info), on the CPU the least of `run.memory_limit_mb`
(this process's resident set), the cgroup's limit less its usage, and the kernel's MemAvailable. A config that does
not fit is refused with one line that names a batch size or a preset that does.
"""
from __future__ import annotations

import contextlib
import gc
import json
import logging
import resource
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger(__name__)

MB = 1e6  # metrics and messages use MB = 10^6 bytes
FIT_MARGIN = 1.15  # the measured peak times this must fit: allocator fragmentation, the DHT child, a longer batch
OOM_MARKER = "out-of-memory.json"

# Parameter-sized fp32 copies at each phase's peak (module docstring); the estimate's constants. The outer step's is
# an upper bound (5 + an exchange of up to 3 with a 16-bit wire, + 1 of margin); the dry run measures the truth.
INNER_COPIES = 6
OUTER_COPIES = 9


# ---------------------------------------------------------------------------------------------- helpers for a round
def outgoing_specs(outer_cfg, params: Sequence[torch.Tensor]) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The shapes and dtypes of `outer.outgoing(params)` without computing it (NoLoCo sends two tensors per
    parameter, `local` nothing): the exchange is sized from these."""
    per = [(tuple(p.shape), p.dtype) for p in params]
    return {"noloco": per + per, "local": []}.get(outer_cfg.algorithm, per)


class _LossOf(nn.Module):
    """`model.loss` as a forward, so torch.func.functional_call can run it with other parameters."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.m = model

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return self.m.loss(batch)


@torch.no_grad()
def evaluate_with(model: nn.Module, point: Sequence[torch.Tensor], batches: Sequence[torch.Tensor],
                  autocast: contextlib.AbstractContextManager | None = None) -> float:
    """Mean loss of `model` with `point` in place of its parameters (in model.parameters() order), over `batches`.
    The model's own tensors are neither copied nor written (torch.func.functional_call swaps references)."""
    names = [n for n, _ in model.named_parameters()]
    if len(names) != len(point):
        raise ValueError(f"{len(point)} tensors for a model of {len(names)} parameters")
    wrapped = _LossOf(model)
    swap = {f"m.{n}": t for n, t in zip(names, point)}
    was_training = model.training
    model.eval()
    dev = next(model.parameters()).device
    try:
        with autocast or contextlib.nullcontext():
            losses = [torch.func.functional_call(wrapped, swap, (b.to(dev),)) for b in batches]
        return float(torch.stack([x.float() for x in losses]).mean())
    finally:
        model.train(was_training)


def is_out_of_memory(err: BaseException) -> bool:
    """A CUDA OOM, Python's MemoryError, or torch's CPU allocator failing (a RuntimeError)."""
    return isinstance(err, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(err, RuntimeError) and "can't allocate memory" in str(err))


# ---------------------------------------------------------------------------------------------- measuring
def _proc_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class RoundPeak:
    """The peak memory since the last `reset()`: on CUDA torch's max allocated bytes; on Linux CPUs the resident
    set's high-water mark (VmHWM, reset by writing 5 to /proc/self/clear_refs); elsewhere the process's lifetime
    peak (ru_maxrss), which `resettable` then says."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.resettable = self.device.type == "cuda" or self._clear_refs()

    def _clear_refs(self) -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return _proc_kib("VmHWM") is not None
        except OSError:
            return False

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.resettable:
            self._clear_refs()

    def bytes(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        hwm = _proc_kib("VmHWM") if self.resettable else None
        if hwm is not None:
            return hwm * 1024
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
        return rss * (1 if sys.platform == "darwin" else 1024)

    def current(self) -> int:
        """What is in use now (the baseline a dry run's peak is measured from)."""
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        rss = _proc_kib("VmRSS")
        return 0 if rss is None else rss * 1024

    def mb(self) -> float:
        return self.bytes() / MB


# ---------------------------------------------------------------------------------------------- headroom
@dataclass
class Headroom:
    bytes: int
    source: str  # what limits it, for the message


def headroom(device: torch.device, memory_limit_mb: float | None = None) -> Headroom:
    """How many more bytes this process may allocate on `device` (module docstring)."""
    if torch.device(device).type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return Headroom(free, f"free on {torch.cuda.get_device_name(device)} ({total / MB:.0f} MB)")
    options = []
    if memory_limit_mb is not None:
        rss = (_proc_kib("VmRSS") or 0) * 1024
        options.append(Headroom(int(memory_limit_mb * MB) - rss, f"under run.memory_limit_mb={memory_limit_mb:g}"))
    cg = _cgroup_headroom()
    if cg is not None:
        options.append(Headroom(cg, "under the cgroup's memory limit"))
    avail = _proc_meminfo_kib("MemAvailable")
    if avail is not None:
        options.append(Headroom(avail * 1024, "available on this machine (MemAvailable)"))
    if not options:
        return Headroom(2**62, "unknown (no limit found)")
    return min(options, key=lambda h: h.bytes)


def _cgroup_headroom() -> int | None:
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            lim = Path(limit).read_text().strip()
            if lim == "max" or int(lim) >= 2**60:
                return None
            return int(lim) - int(Path(usage).read_text().strip())
        except (OSError, ValueError):
            continue
    return None


def _proc_meminfo_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


# ---------------------------------------------------------------------------------------------- estimating
def num_params(model_cfg, vocab_size: int) -> int:
    """Parameters of a preset, counted on the meta device (no memory)."""
    from gasloc.peer.train.model import LlamaLM

    with torch.device("meta"):
        return LlamaLM(model_cfg, vocab_size).num_params()


def activation_bytes(model_cfg, vocab_size: int, batch_size: int, cuda: bool) -> int:
    """Rough bytes of what backward keeps of one step: per layer the block's inputs, norms, q/k/v, attention output
    and the MLP's three projections (bf16 under autocast on CUDA, fp32 on the CPU), and the logits with their fp32
    copy and gradient. An order-of-magnitude term next to the parameter copies; the dry run measures the truth."""
    from gasloc.peer.train.model import PRESETS

    p = PRESETS[model_cfg.preset]
    tokens = batch_size * model_cfg.seq_len
    width = 2 if cuda else 4
    kv = p.dim // p.n_heads * p.n_kv_heads
    per_layer = tokens * (6 * p.dim + 2 * kv + 3 * p.ffn_dim) * width
    logits = tokens * vocab_size * (width + 4 + 4)
    return p.n_layers * per_layer + logits


def estimate_bytes(model_cfg, vocab_size: int, batch_size: int, cuda: bool) -> int:
    """The analytic peak of one round above the runtime's own memory (module docstring's copy counts)."""
    n4 = 4 * num_params(model_cfg, vocab_size)
    return max(INNER_COPIES * n4 + activation_bytes(model_cfg, vocab_size, batch_size, cuda), OUTER_COPIES * n4)


# ---------------------------------------------------------------------------------------------- the dry run
def dry_run(cfg, vocab_size: int, device: torch.device, staging=None) -> int:
    """One inner step after a warm-up step (AdamW's moments exist then) and one outer step with a mix and a
    partner's batch check, on a throwaway model of `cfg` (a PeerConfig); the peak bytes above what was in use
    before. The same functions a round calls; nothing of the peer's own state is touched. `staging`: the
    exchange's buffer class (peer/transport/staging.py Staging, which the training side may not import: the
    caller passes it); None: a lossless stand-in, one received copy."""
    from gasloc.peer.train.inner import inner_step_on_device, make_inner_optimizer
    from gasloc.peer.train.model import LlamaLM, autocast_for
    from gasloc.peer.train.outer import make_outer

    device = torch.device(device)
    peak = RoundPeak(device)
    if device.type == "cpu" and not peak.resettable:
        raise RuntimeError("no resettable peak memory on this platform")
    if device.type == "cpu":
        # A CPU peak is the resident set's: garbage collected mid-run would lower it, and freed heap pages still
        # resident would be reused without raising it; either reads the round smaller than it is.
        gc.collect()
        release_freed_host_memory()
    base = peak.current()
    peak.reset()
    autocast = autocast_for(device)
    model = LlamaLM(cfg.model, vocab_size).to(device)
    params = list(model.parameters())
    opt = make_inner_optimizer(model, cfg.inner)
    outer = make_outer(cfg.outer, params)
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, vocab_size, (cfg.data.batch_size, cfg.model.seq_len + 1), generator=g).to(device)
    for step in range(2):
        inner_step_on_device(model, opt, batch, step, cfg.inner, autocast)
    opt.zero_grad(set_to_none=True)  # as run_inner_phase does at the phase's end
    _dry_exchange(cfg, model, params, outer, batch, autocast, device, staging)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    used = peak.bytes() - base
    del model, params, opt, outer, batch
    if device.type == "cuda":
        torch.cuda.empty_cache()
    else:
        release_freed_host_memory()
    return max(used, 0)


# glibc's mallopt(M_MMAP_THRESHOLD, ...) (malloc.h), and the value a CPU peer sets (compact_host_heap)
_M_MMAP_THRESHOLD = -3
HOST_MMAP_THRESHOLD = 128 * 1024


def compact_host_heap() -> bool:
    """A CPU peer (its host memory is its training memory): from now on every allocation of HOST_MMAP_THRESHOLD or
    more gets a mapping of its own, which goes back to the kernel when freed. glibc starts there too, but raises the
    threshold to the size of each large block freed (up to 32 MB), after which parameter-sized tensors live in the
    heap: what one phase of a round frees (the gradients, the exchange's buffers) stays resident, and another phase's
    tensors of other sizes, or from another thread's arena, do not fit in it. Measured on a medium peer pair (int8
    wire, docs/gpu.md): 1.7-2.3 parameter copies of free heap held at the round's peak, gone with this. Costs a page
    fault per fresh 4 KB of a large tensor (the gradients each inner step: ~50 ms a step on medium at batch 1, a few
    per cent at real batch sizes). Setting the threshold also stops glibc's dynamic raise. False where the C
    library is not glibc (nothing is changed)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes
        return bool(ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, HOST_MMAP_THRESHOLD))
    except (OSError, AttributeError):
        return False


def release_freed_host_memory() -> None:
    """Hand the heap's freed pages back to the kernel (glibc's malloc_trim): otherwise the dry run's freed tensors
    stay in the resident set, and a later peak reads low (the allocator reuses them) while RSS stays high."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl): nothing to trim this way
        pass


def _dry_exchange(cfg, model, params, outer, batch, autocast, device, staging_cls) -> None:
    """What we send (`outer.outgoing`, as the daemon's rounds), an exchange with ourselves through the exchange's
    own staging (peer/transport/staging.py: our payload, the decoded copy of our wire form, the partner's payload
    and its decoded tensors), then the daemon's steps: the received tensors on the device, a partner's batch check,
    the in-place symmetric mix, the outer step. A modulo codec's peer also runs the next round with a partner of
    another codec (exchange.py `_wire_tensors`): it sends FALLBACK_CODEC from buffers of their own, which hold our
    own wire form decoded, and receives the partner's codec, at most float32's bytes, while its staging keeps its
    own send buffers."""
    from gasloc.protocol.averaging import group_mean_weight, mix_pair_
    from gasloc.protocol.codec import FALLBACK_CODEC, parse
    from gasloc.protocol.messages import TensorSpec

    sent = outer.outgoing(params, in_place=not cfg.outer.overlap)  # as the daemon's rounds
    if not sent:
        return
    if staging_cls is None:
        received = [t.detach().to("cpu", copy=True).to(device) for t in sent]
        mixed = mix_pair_(received, sent, None, group_mean_weight(1))
        outer.apply(params, mixed if cfg.outer.algorithm != "diloco" else received)
        return
    codec = parse(cfg.exchange.codec)
    specs = [TensorSpec.of(tuple(t.shape), t.dtype) for t in sent]
    staging = staging_cls(specs, codec)
    _dry_pair(cfg, model, params, outer, sent, batch, autocast, device, staging, staging, codec)
    if codec.modulo:   # the next round, with a partner of another codec; our staging keeps its buffers
        del sent
        sent = outer.outgoing(params, in_place=not cfg.outer.overlap)
        _dry_pair(cfg, model, params, outer, sent, batch, autocast, device, staging,
                  staging_cls(specs, parse(FALLBACK_CODEC)), parse("float32"))


def _dry_pair(cfg, model, params, outer, sent, batch, autocast, device, staging, sender, theirs) -> None:
    """One exchange of `_dry_exchange` and the outer step after it: `sender` (a staging) encodes what we send,
    `staging` receives the partner's payload in `theirs` (our own payload where the codecs agree, else our tensors
    in `theirs`, a lossless codec)."""
    from gasloc.protocol.averaging import group_mean_weight, mix_pair_
    from gasloc.protocol.codec import probe, probe_steps

    steps = None
    if sender.codec.modulo:   # with ourselves both probes agree (the smallest step): the buffers, not the values, count
        own_probe = probe(sent, 0)
        steps = probe_steps(sender.codec, [t.numel() for t in sent], own_probe, own_probe)
    payload = sender.encode(sent, seed=0, steps=steps)
    own_wire = sender.own_wire(payload, sent, seed=0)
    idle = outer.idle_buffers()
    if idle is not None and device.type == "cpu":  # as the daemon: the partner's tensors land in the anchor
        staging.recycle(idle)
    bufs, out = staging.receive_buffers(theirs)
    if bufs is out:           # zero-copy: the partner's tensors land where they are read
        for o, t in zip(out, sent):
            o.copy_(t)
    elif theirs == sender.codec:
        for b, p in zip(bufs, payload):
            b.copy_(p.reshape(-1).view(b.dtype) if p.dtype != b.dtype else p.reshape(b.shape))
    else:                     # a lossless partner of another dtype: its bytes are a cast of ours
        for b, t in zip(bufs, sent):
            b.view(theirs.cast).copy_(t.reshape(-1))
    if theirs.modulo:   # the partner's codes against our own tensors and our own codes
        staging.decode(theirs, bufs, out, 0, sent, payload, steps)
    else:
        staging.decode(theirs, bufs, out, 0, own_wire if theirs.sparse else None)
    received = [t.to(device) for t in out]
    wire = None if own_wire is None else [t.to(device) for t in own_wire]
    if len(received) == len(params):
        evaluate_with(model, received, [batch[:1]], autocast)  # a suspicious partner's batch check
    mixed = mix_pair_(received, sent, wire, group_mean_weight(1)) if cfg.outer.algorithm != "diloco" else received
    outer.apply(params, mixed)


class DoesNotFit(Exception):
    """The config's round needs more memory than there is (at start, or it ran out mid-run): one line for the user,
    and this exit code (`gasloc peer`), which a restart with the same settings gets again at once."""
    exit_code = 3


@dataclass
class Fit:
    need_bytes: int       # the round's peak above the runtime (measured, or estimated when `measured` is False)
    headroom: Headroom
    measured: bool

    @property
    def ok(self) -> bool:
        return self.need_bytes * FIT_MARGIN <= self.headroom.bytes


def check_fit(cfg, vocab_size: int, device: torch.device, staging=None) -> Fit:
    """Estimate, then measure (dry_run, with the exchange's `staging` class); raise DoesNotFit with one line naming
    what fits, else return the Fit."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    room = headroom(device, cfg.run.memory_limit_mb)
    est = estimate_bytes(cfg.model, vocab_size, cfg.data.batch_size, cuda)
    if est * FIT_MARGIN > 1.5 * room.bytes:  # far too large: do not even try (the kernel's OOM killer would)
        raise DoesNotFit(_refusal(cfg, vocab_size, cuda, Fit(est, room, measured=False), scale=1.0))
    t0 = time.monotonic()
    try:
        need = dry_run(cfg, vocab_size, device, staging)
    except Exception as e:  # noqa: BLE001 - only an OOM is an answer here; anything else propagates
        if not is_out_of_memory(e):
            raise
        if cuda:
            torch.cuda.empty_cache()
        raise DoesNotFit(_refusal(cfg, vocab_size, cuda, Fit(est, room, measured=False), scale=1.0,
                                  oom=True)) from None
    fit = Fit(need, room, measured=True)
    log.info("memory_check need_mb=%.0f estimate_mb=%.0f headroom_mb=%.0f (%s) dry_run_s=%.1f", need / MB,
             est / MB, room.bytes / MB, room.source, time.monotonic() - t0)
    if not fit.ok:
        raise DoesNotFit(_refusal(cfg, vocab_size, cuda, fit, scale=need / max(est, 1)))
    return fit


def suggestion(cfg, vocab_size: int, cuda: bool, room: int, scale: float) -> str:
    """What fits in `room`: a smaller data.batch_size of this preset, else a smaller preset (the run's peers must
    then all use it: the model is part of the run's fingerprint). `scale` calibrates the estimate by the dry run."""
    from gasloc.peer.train.model import PRESETS

    def fits(model_cfg, batch: int) -> bool:
        return scale * estimate_bytes(model_cfg, vocab_size, batch, cuda) * FIT_MARGIN <= room

    b = cfg.data.batch_size // 2
    while b >= 1:
        if fits(cfg.model, b):
            return (f"data.batch_size={b} fits (estimated "
                    f"{scale * estimate_bytes(cfg.model, vocab_size, b, cuda) / MB:.0f} MB)")
        b //= 2
    names = list(PRESETS)
    for name in reversed(names[:names.index(cfg.model.preset)]):
        smaller = cfg.model.model_copy(update={"preset": name})
        for batch in (cfg.data.batch_size, 1):
            if fits(smaller, batch):
                est = scale * estimate_bytes(smaller, vocab_size, batch, cuda)
                how = "" if batch == cfg.data.batch_size else f" with data.batch_size={batch}"
                return f"model.preset='{name}'{how} fits (estimated {est / MB:.0f} MB; every peer of a run uses one)"
    return "no preset fits; free memory or use a machine with more"


def _refusal(cfg, vocab_size: int, cuda: bool, fit: Fit, scale: float, oom: bool = False) -> str:
    how = ("ran out of memory in a dry inner and outer step" if oom else
           f"needs {fit.need_bytes / MB:.0f} MB at a round's peak ("
           + ("measured by a dry inner and outer step" if fit.measured else "estimated") + ")")
    margin = f", {fit.need_bytes * FIT_MARGIN / MB:.0f} MB with a {FIT_MARGIN - 1:.0%} margin" if not oom else ""
    return (f"model.preset='{cfg.model.preset}' with data.batch_size={cfg.data.batch_size} and "
            f"model.seq_len={cfg.model.seq_len} {how}{margin}; {max(fit.headroom.bytes, 0) / MB:.0f} MB "
            f"{fit.headroom.source}: {suggestion(cfg, vocab_size, cuda, max(fit.headroom.bytes, 0), scale)}")


# ---------------------------------------------------------------------------------------------- out of memory
def memory_settings(cfg, device: torch.device) -> dict:
    """What decides a round's memory: an out-of-memory marker holds for these settings only."""
    return {"preset": cfg.model.preset, "seq_len": cfg.model.seq_len, "batch_size": cfg.data.batch_size,
            "device": torch.device(device).type, "algorithm": cfg.outer.algorithm}


def write_oom_marker(run_dir: Path, cfg, device: torch.device, round: int, err: BaseException) -> Path:
    """Leave a note that these settings ran out of memory, so a restarted peer refuses at once instead of training
    into the same peak again (a crash loop under `restart: unless-stopped`)."""
    path = Path(run_dir) / OOM_MARKER
    reason = str(err).splitlines()[0][:300] if str(err) else type(err).__name__
    path.write_text(json.dumps({"settings": memory_settings(cfg, device), "round": round, "error": reason,
                                "time": time.time()}) + "\n")
    return path


def oom_refusal(run_dir: Path, cfg, device: torch.device) -> str | None:
    """One line when this run directory's peer ran out of memory with the same settings; None otherwise (a marker
    for other settings is removed: they changed, so the peer tries)."""
    path = Path(run_dir) / OOM_MARKER
    try:
        note = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        note = {}
    if note.get("settings") != memory_settings(cfg, device):
        path.unlink(missing_ok=True)
        return None
    s = note["settings"]
    return (f"this peer ran out of memory in round {note.get('round')} with model.preset='{s['preset']}' "
            f"data.batch_size={s['batch_size']} model.seq_len={s['seq_len']} on {s['device']} ({note.get('error')}); "
            f"it does not start again with the same settings: lower data.batch_size or model.seq_len, or delete "
            f"{path} to try again")


def human(n_bytes: float) -> str:
    return f"{n_bytes / MB:.0f} MB" if n_bytes < 10 * 1e9 else f"{n_bytes / 1e9:.1f} GB"
