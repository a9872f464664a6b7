"""Tokens for training and validation: the tokenizer, the embedded default corpus, per-worker shards.

Every source yields [B, T+1] int64 batches through `next_batch()` and is resumable from `state_dict()` (a small
JSON-able dict saved in checkpoints). Validation batches come from a held-out split that no worker trains on.
"""
from __future__ import annotations

import gzip
import hashlib
from functools import lru_cache
from importlib import resources
from typing import Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

EMBEDDED_CORPUS = "python-reference.txt.gz"
BLOCK_TOKENS = 2048  # shards are made of whole blocks of this many tokens, dealt out after a seeded shuffle


class DataConfig(BaseModel):
    """Where tokens come from and how this worker's share of them is chosen."""
    model_config = ConfigDict(extra="forbid")

    source: Literal["embedded"] = Field("embedded", description="embedded: the corpus shipped with gasloc")
    batch_size: int = Field(8, ge=1, description="sequences per inner step")
    val_fraction: float = Field(0.05, gt=0, lt=0.5, description="held-out tail of the corpus for validation")
    val_batches: int = Field(4, ge=1, description="batches per validation pass")
    seed: int = Field(0, description="seed of the shard shuffle; every worker of a run must use the same one")
    shard_index: int | None = Field(None, ge=0, description="this worker's shard; unset: a random window stream "
                                    "over all training data, seeded by the worker")
    num_shards: int = Field(1, ge=1, description="how many disjoint shards the training split is cut into")

    @model_validator(mode="after")
    def _shard_in_range(self) -> "DataConfig":
        if self.shard_index is not None and self.shard_index >= self.num_shards:
            raise ValueError(f"shard_index {self.shard_index} must be below num_shards {self.num_shards}")
        return self


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, nothing to download."""
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


@lru_cache(maxsize=1)
def embedded_tokens() -> np.ndarray:
    """The embedded corpus as byte tokens (~466k tokens of the Python Language Reference; see corpus/NOTICE)."""
    raw = resources.files("gasloc.peer").joinpath("corpus", EMBEDDED_CORPUS).read_bytes()
    return np.frombuffer(gzip.decompress(raw), dtype=np.uint8)


def _seed_of(*parts) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little") & (2**63 - 1)


class WindowSampler:
    """Random windows of T+1 tokens from a token array, restricted to some blocks of it.

    Batch n is a pure function of (seed, stream, n), so resuming needs only n: `state_dict() == {"batches": n}`.
    """

    def __init__(self, tokens: np.ndarray, blocks: np.ndarray, seq_len: int, batch_size: int, seed: int,
                 stream: str):
        self.tokens, self.blocks = tokens, blocks
        self.seq_len, self.batch_size, self.seed, self.stream = seq_len, batch_size, seed, stream
        self.batches = 0
        if len(blocks) == 0:
            raise ValueError("this shard has no data: use fewer shards or a larger corpus")

    def next_batch(self) -> torch.Tensor:
        rng = np.random.default_rng(_seed_of(self.seed, self.stream, self.batches))
        self.batches += 1
        span = self.seq_len + 1
        block = self.blocks[rng.integers(0, len(self.blocks), self.batch_size)]
        # a window may run past its block into the next one; it never runs past the end of the array
        starts = np.minimum(block * BLOCK_TOKENS + rng.integers(0, BLOCK_TOKENS, self.batch_size),
                            len(self.tokens) - span)
        idx = starts[:, None] + np.arange(span)[None, :]
        return torch.from_numpy(self.tokens[idx].astype(np.int64))

    def state_dict(self) -> dict:
        return {"batches": self.batches}

    def load_state_dict(self, state: dict) -> None:
        self.batches = int(state["batches"])


class TokenData:
    """A worker's view of a token array: its training shard and the shared validation split."""

    def __init__(self, tokens: np.ndarray, cfg: DataConfig, seq_len: int, worker_seed: int | str = 0):
        if len(tokens) < 4 * (seq_len + 1):
            raise ValueError(f"only {len(tokens)} tokens: too few for seq_len {seq_len}")
        self.cfg, self.seq_len, self.tokens = cfg, seq_len, tokens
        n_val = max(int(len(tokens) * cfg.val_fraction), 2 * (seq_len + 1))
        self.train_tokens, self.val_tokens = tokens[:-n_val], tokens[-n_val:]
        n_blocks = max(len(self.train_tokens) // BLOCK_TOKENS, 1)
        order = np.random.default_rng(_seed_of(cfg.seed, "shuffle")).permutation(n_blocks)
        if cfg.shard_index is None:
            blocks, stream = order, f"worker-{worker_seed}"
        else:  # disjoint: shard s owns blocks order[s], order[s + S], ...
            blocks, stream = order[cfg.shard_index::cfg.num_shards], f"shard-{cfg.shard_index}"
        self.train = WindowSampler(self.train_tokens, np.sort(blocks), seq_len, cfg.batch_size, cfg.seed, stream)

    def next_batch(self) -> torch.Tensor:
        return self.train.next_batch()

    def val_batches(self) -> list[torch.Tensor]:
        """The same validation batches for every worker and every call (evenly spaced windows)."""
        span = self.seq_len + 1
        n = self.cfg.val_batches * self.cfg.batch_size
        starts = np.linspace(0, len(self.val_tokens) - span, n).astype(np.int64)
        windows = self.val_tokens[starts[:, None] + np.arange(span)[None, :]].astype(np.int64)
        return list(torch.from_numpy(windows).split(self.cfg.batch_size))

    def state_dict(self) -> dict:
        return self.train.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.train.load_state_dict(state)


def build_data(cfg: DataConfig, seq_len: int, worker_seed: int | str = 0) -> tuple[TokenData, ByteTokenizer]:
    """The data source and tokenizer named by `cfg`."""
    tok = ByteTokenizer()
    return TokenData(embedded_tokens(), cfg, seq_len, worker_seed), tok


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[torch.Tensor]) -> float:
    """Mean validation loss (nats/token) of `model` over `batches`."""
    was_training = model.training
    model.eval()
    dev = next(model.parameters()).device
    total = sum(float(model.loss(b.to(dev))) for b in batches) / len(batches)
    model.train(was_training)
    return total
