"""One peer's training on a GPU, per preset (issue 31 item 4): tokens/s, MFU and the peak memory of a round, from the
smallest preset up to the largest that fits, and the time of one exchange's staging (our tensors encoded into the
exchange's pinned host buffers, the partner's decoded and moved to the device). Everything runs the peer's own
functions (inner steps under bf16 autocast, optionally torch.compile, the start-up dry run for the peak, the
exchange's Staging), on one process, without a network.

    python bench/gpu.py --json gpu.json                        # every preset that fits, default codec
    python bench/gpu.py --presets tiny,small --steps 5 --device cpu   # a smoke run of the script itself

MFU = achieved model FLOP/s over the device's peak dense bf16 FLOP/s (--peak-tflops, else looked up from the device
name; none: not reported). Model FLOPs per token: 6 x parameters (without the embedding) + 12 x layers x dim x
seq_len (attention), the nanoGPT/PaLM count.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click
import torch

# dense bf16 peak TFLOP/s by device name (vendor datasheets, without sparsity)
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "RTX 4090": 165.0,
               "L4": 121.0, "A6000": 155.0}


def device_peak_tflops(device: torch.device, given: float | None) -> float | None:
    if given is not None:
        return given
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def flops_per_token(model, seq_len: int) -> float:
    p = model.preset
    n = model.num_params() - model.model.embed_tokens.weight.numel()
    return 6 * n + 12 * p.n_layers * p.dim * seq_len


def measure_preset(preset: str, args: dict, device: torch.device) -> dict:
    from gasloc.peer.config import PeerConfig
    from gasloc.peer.train.inner import inner_step_on_device, make_inner_optimizer
    from gasloc.peer.train.memory import dry_run, num_params
    from gasloc.peer.train.model import autocast_for, build_model, maybe_compile
    from gasloc.peer.train.outer import make_outer
    from gasloc.peer.transport.staging import Staging

    cfg = PeerConfig.model_validate({"model": {"preset": preset, "seq_len": args["seq_len"],
                                               "compile": args["compile"]},
                                     "data": {"batch_size": args["batch_size"]},
                                     "exchange": {"codec": args["codec"]}, "run": {"device": device.type}})
    vocab = args["vocab"]
    n = num_params(cfg.model, vocab)
    peak = dry_run(cfg, vocab, device, Staging)  # the round's peak, as the peer's start-up check measures it
    model = build_model(cfg.model, vocab).to(device)
    maybe_compile(model, cfg.model, device)
    opt = make_inner_optimizer(model, cfg.inner)
    outer = make_outer(cfg.outer, list(model.parameters()))
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, vocab, (cfg.data.batch_size, cfg.model.seq_len + 1), generator=g)
               for _ in range(4)]
    autocast = autocast_for(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for i in range(args["warmup"]):  # compile, allocator, cuBLAS heuristics
        inner_step_on_device(model, opt, batches[i % 4].to(device), i, cfg.inner, autocast)
    sync()
    t0 = time.perf_counter()
    total = None
    for i in range(args["steps"]):
        loss = inner_step_on_device(model, opt, batches[i % 4].to(device, non_blocking=True), i, cfg.inner, autocast)
        total = loss if total is None else total + loss
    sync()
    step_s = (time.perf_counter() - t0) / args["steps"]
    tokens_s = cfg.data.batch_size * cfg.model.seq_len / step_s
    fpt = flops_per_token(model, cfg.model.seq_len)
    peak_tf = args["peak_tflops"]
    staging_s = time_staging(cfg, model, outer, device)
    row = {"preset": preset, "params": n, "batch_size": cfg.data.batch_size, "seq_len": cfg.model.seq_len,
           "compile": cfg.model.compile, "step_s": step_s, "tokens_per_s": tokens_s,
           "model_tflops": fpt * tokens_s / 1e12, "mfu": None if peak_tf is None else fpt * tokens_s / 1e12 / peak_tf,
           "peak_mem_mb": peak / 1e6, "peak_copies": peak / (4 * n), "staging_s": staging_s,
           "loss_mean": float(total) / args["steps"]}
    del model, opt, outer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def time_staging(cfg, model, outer, device: torch.device) -> dict:
    """One exchange's staging both ways, median of 3: encode (device -> pinned host, codec), own wire form, and the
    partner's payload decoded and moved to the device (as the daemon does before mixing)."""
    from gasloc.peer.transport.staging import Staging
    from gasloc.protocol.codec import parse
    from gasloc.protocol.messages import TensorSpec

    params = list(model.parameters())
    sent = outer.outgoing(params)
    codec = parse(cfg.exchange.codec)
    staging = Staging([TensorSpec.of(tuple(t.shape), t.dtype) for t in sent], codec)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    enc, dec = [], []
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        payload = staging.encode(sent, seed=0)
        own = staging.own_wire(payload, sent, seed=0)
        t1 = time.perf_counter()
        bufs, out = staging.receive_buffers(codec)
        if bufs is not out:
            for b, p in zip(bufs, payload):
                b.copy_(p.reshape(b.shape))
        staging.decode(codec, bufs, out, 0, own if codec.sparse else None)
        [t.to(device, non_blocking=True) for t in out]
        sync()
        t2 = time.perf_counter()
        staging.recycle(out)
        enc.append(t1 - t0)
        dec.append(t2 - t1)
    outer.apply(params, sent)
    return {"encode_s": sorted(enc)[1], "decode_to_device_s": sorted(dec)[1], "codec": codec.name}


@click.command()
@click.option("--presets", default="tiny,small,medium,large,xl,1b", help="in increasing size; stops at the first "
              "that does not fit")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default="cuda")
@click.option("--batch-size", default=8, type=click.IntRange(1))
@click.option("--seq-len", default=1024, type=click.IntRange(8))
@click.option("--vocab", default=32000, type=click.IntRange(2), help="vocabulary size (32000: a Llama tokenizer)")
@click.option("--codec", default="int4")
@click.option("--compile/--no-compile", default=True, help="torch.compile the model (CUDA only)")
@click.option("--steps", default=20, type=click.IntRange(1))
@click.option("--warmup", default=5, type=click.IntRange(1))
@click.option("--peak-tflops", type=float, default=None, help="the device's dense bf16 peak, for MFU")
@click.option("--json", "json_out", type=click.Path(path_type=Path), default=None)
def main(presets, device, batch_size, seq_len, vocab, codec, compile, steps, warmup, peak_tflops, json_out):
    from gasloc.peer.train.memory import DoesNotFit, check_fit, is_out_of_memory
    from gasloc.peer.transport.staging import Staging

    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        click.echo("Error: no CUDA device (use --device cpu for a smoke run)", err=True)
        sys.exit(2)
    args = {"batch_size": batch_size, "seq_len": seq_len, "vocab": vocab, "codec": codec, "compile": compile,
            "steps": steps, "warmup": warmup, "peak_tflops": device_peak_tflops(dev, peak_tflops)}
    rows, stopped = [], None
    for preset in [p.strip() for p in presets.split(",") if p.strip()]:
        from gasloc.peer.config import PeerConfig
        cfg = PeerConfig.model_validate({"model": {"preset": preset, "seq_len": seq_len},
                                         "data": {"batch_size": batch_size}, "exchange": {"codec": codec}})
        try:
            check_fit(cfg, vocab, dev, Staging)  # the peer's own start-up check: what it would refuse, we do not run
            rows.append(measure_preset(preset, args, dev))
        except DoesNotFit as e:
            stopped = f"{preset}: {e}"
            break
        except RuntimeError as e:
            if not is_out_of_memory(e):
                raise
            stopped = f"{preset}: out of memory while measuring ({str(e).splitlines()[0][:160]})"
            break
        r = rows[-1]
        click.echo(f"preset={preset} params={r['params'] / 1e6:.1f}M tokens/s={r['tokens_per_s']:.0f} "
                   f"mfu={'-' if r['mfu'] is None else format(r['mfu'], '.3f')} peak_mem_mb={r['peak_mem_mb']:.0f} "
                   f"({r['peak_copies']:.1f} parameter copies) staging encode_s={r['staging_s']['encode_s']:.4f} "
                   f"decode_s={r['staging_s']['decode_to_device_s']:.4f}", err=False)
    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    if stopped:
        click.echo(f"stopped at {stopped}")
    result = {"device": device_name, "torch": torch.__version__, "args": args, "rows": rows, "stopped": stopped}
    if json_out is not None:
        json_out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
