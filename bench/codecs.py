"""Codec speed (issue 32): each wire codec's encode and decode of a model-sized payload on this machine's CPU.

    python bench/codecs.py                          # 25M parameters, every codec, 5 repetitions
    python bench/codecs.py --params 100M --codecs int4,int8 --threads 2 --json out.json

A codec must keep up with the link: it encodes and decodes faster than 1 Gbit/s of raw payload (the fp32 tensors
it stands for). Each row also has the ratio against a plain copy of the same fp32 tensors measured in the same run
(`torch.Tensor.copy_`, the memory bandwidth the machine gives right now), so a loaded machine reads as one. The
tensors are those the exchange sends (protocol/codec.py, through peer/transport/staging.py's buffers): encode into
the send buffers, decode into preallocated model tensors.
"""
from __future__ import annotations

import json
import statistics
import time

import click
import torch

from gasloc.peer.transport.staging import Staging
from gasloc.protocol.codec import CodecError, parse, probe, probe_steps
from gasloc.protocol.messages import TensorSpec

CODECS = ("float16", "int8", "int4", "int4-rn", "int3", "int8-p10", "int4-p20")
GBIT = 1e9 / 8   # bytes a second


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1e3, "M": 1e6, "G": 1e9}.get(s[-1:], 1)
    return int(float(s.rstrip("KMG")) * mult)


def best_of(reps: int, fn) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(name: str, params: int, reps: int) -> dict:
    # four tensors like a model's big matrices, plus a small one (an RMSNorm gain): padding and small tensors count
    shapes = [(params // 4 - 256,)] * 4 + [(1024,)]
    specs = [TensorSpec.of(s, torch.float32) for s in shapes]
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(s, generator=g) * 0.02 for s in shapes]
    codec = parse(name)
    staging = Staging(specs, codec)
    seed = 12345
    steps = received = None
    if codec.modulo:   # a partner 2.5 % of a weight away; the steps from both probes, as an exchange sizes them
        partner = [t + torch.randn(t.shape, generator=g) * 0.0005 for t in tensors]
        steps = probe_steps(codec, [t.numel() for t in tensors], probe(tensors, seed), probe(partner, seed))
        received = Staging(specs, codec).encode(partner, seed, steps)
    payload = staging.encode(tensors, seed, steps)
    _, out = staging.receive_buffers(codec)
    fill = staging.own_wire(payload, tensors, seed) if codec.sparse else None
    enc = best_of(reps, lambda: staging.encode(tensors, seed, steps))
    if codec.modulo:   # the partner's codes against our own tensors and our own codes
        dec = best_of(reps, lambda: staging.decode(codec, received, out, seed, tensors, payload, steps))
    else:
        dec = best_of(reps, lambda: staging.decode(codec, payload, out, seed, fill))
    copy_dst = [torch.empty_like(t) for t in tensors]
    copy = best_of(reps, lambda: torch._foreach_copy_(copy_dst, tensors))
    raw = sum(t.numel() for t in tensors) * 4
    wire = staging.payload_bytes()
    return {"codec": name, "params": sum(t.numel() for t in tensors), "bits_per_param": 8 * wire / (raw / 4),
            "encode_s": enc, "decode_s": dec, "copy_s": copy,
            "encode_raw_gbit_s": raw / enc / GBIT, "decode_raw_gbit_s": raw / dec / GBIT,
            "encode_vs_copy": copy / enc, "decode_vs_copy": copy / dec,
            "keeps_up_1gbit": raw / enc >= GBIT and raw / dec >= GBIT}


@click.command()
@click.option("--params", default="25M", show_default=True, help="parameters in the payload (e.g. 25M, 100M)")
@click.option("--codecs", default=",".join(CODECS), show_default=True, help="codecs, comma-separated")
@click.option("--reps", default=5, show_default=True, type=click.IntRange(1, 100))
@click.option("--threads", default=None, type=click.IntRange(1, 256), help="torch threads (default: torch's)")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None)
def main(params: str, codecs: str, reps: int, threads: int | None, json_out: str | None) -> None:
    if threads:
        torch.set_num_threads(threads)
    try:
        n = parse_size(params)
        names = [c for c in codecs.split(",") if c]
        for c in names:
            parse(c)
    except (ValueError, CodecError) as e:
        raise click.UsageError(str(e)) from None
    rows = [measure(c, n, reps) for c in names]
    print(f"{n / 1e6:.0f}M parameters, {torch.get_num_threads()} torch thread(s), median of {reps}; raw = the fp32 "
          f"tensors a payload stands for")
    print(f"{'codec':10} {'bits/param':>10} {'encode s':>9} {'decode s':>9} {'enc Gbit/s raw':>15} "
          f"{'dec Gbit/s raw':>15} {'enc/copy':>9} {'dec/copy':>9}  >= 1 Gbit/s")
    for r in rows:
        print(f"{r['codec']:10} {r['bits_per_param']:10.3f} {r['encode_s']:9.3f} {r['decode_s']:9.3f} "
              f"{r['encode_raw_gbit_s']:15.2f} {r['decode_raw_gbit_s']:15.2f} {r['encode_vs_copy']:9.3f} "
              f"{r['decode_vs_copy']:9.3f}  {'yes' if r['keeps_up_1gbit'] else 'NO'}")
    if json_out:
        with open(json_out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
