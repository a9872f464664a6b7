"""Tokens for training and validation: the data sources, the tokenizer, per-worker shards.

Sources (DataConfig.source): the embedded corpus (default), local .txt/.jsonl files, pre-tokenized token shards
(memory-mapped; see sources.py for the format and `gasloc tokenize` to make them), and a streamed Hugging Face
dataset (stream.py). Every source yields [B, T+1] int64 batches through `next_batch()` and is resumable from
`state_dict()` (a small JSON-able dict saved in checkpoints). Validation batches come from a held-out split that no
worker trains on.
"""
from __future__ import annotations

import gzip
import hashlib
import logging
import secrets
from functools import lru_cache, partial
from importlib import resources
from typing import Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from gasloc.peer.train.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, token_dtype

__all__ = ["DataConfig", "ByteTokenizer", "HFTokenizer", "TokenData", "build_data", "evaluate", "embedded_tokens",
           "private_batches"]

log = logging.getLogger(__name__)

EMBEDDED_CORPUS = "python-reference.txt.gz"
BLOCK_TOKENS = 2048  # shards are made of whole blocks of this many tokens, dealt out after a seeded shuffle
ENCODE_CHUNK_DOCS = 256  # documents per tokenizer call when reading files


class DataConfig(BaseModel):
    """Where tokens come from and how this worker's share of them is chosen."""
    model_config = ConfigDict(extra="forbid")

    source: Literal["embedded", "files", "tokens", "hf"] = Field(
        "embedded", description="embedded: the corpus shipped with gasloc; files: local .txt/.jsonl files (paths); "
        "tokens: token shards made by `gasloc tokenize` (paths, memory-mapped); hf: a Hugging Face dataset, "
        "streamed (hf_dataset)")
    paths: list[str] = Field(default_factory=list, description="files: .txt/.jsonl(.gz) globs; tokens: .bin/.npy "
                             "globs; hf: optional data_files passed to datasets.load_dataset")
    text_field: str = Field("text", description="the text field of a .jsonl line or a dataset row")
    tokenizer: str = Field("bytes", description="'bytes' (vocabulary 256), or a Hugging Face tokenizer: a "
                           "tokenizer.json, a directory holding one, or a hub model name")
    hf_dataset: str | None = Field(None, description="hf: dataset name on the hub (e.g. HuggingFaceFW/fineweb-edu), "
                                   "a builder such as 'json'/'parquet' used with paths, or a local directory")
    hf_config: str | None = Field(None, description="hf: dataset configuration (e.g. sample-10BT)")
    hf_split: str = Field("train", description="hf: the split to train on")
    hf_val_split: str | None = Field(None, description="hf: a separate validation split; unset: the first "
                                     "hf_val_docs documents of hf_split, which no peer trains on")
    hf_val_docs: int = Field(256, ge=1, description="hf without hf_val_split: documents held out for validation")
    batch_size: int = Field(8, ge=1, description="sequences per inner step")
    val_fraction: float = Field(0.05, gt=0, lt=0.5, description="embedded/files/tokens: held-out tail of the "
                                "tokens for validation")
    val_batches: int = Field(4, ge=1, description="batches per validation pass")
    seed: int = Field(0, description="seed of the shard shuffle; every worker of a run must use the same one")
    shard_index: int | None = Field(None, ge=0, description="this worker's shard (required for hf); unset: a "
                                    "random window stream over all training data, seeded by the worker")
    num_shards: int = Field(1, ge=1, description="how many disjoint shards the training data is cut into (hf: "
                            "see hf_shard_by)")
    hf_shard_by: Literal["auto", "file", "document"] = Field(
        "auto", description="hf: file: each shard streams only its own files (contiguous runs of the dataset's "
        "files; needs at least num_shards files), so a peer downloads about 1/num_shards of the data; document: "
        "every peer reads the whole stream and keeps document i when i mod num_shards == shard_index (any file "
        "count, but every peer downloads everything); auto: file when the dataset has at least num_shards files, "
        "else document")

    @model_validator(mode="after")
    def _consistent(self) -> DataConfig:
        if self.shard_index is not None and self.shard_index >= self.num_shards:
            raise ValueError(f"shard_index {self.shard_index} must be below num_shards {self.num_shards}")
        if self.source in ("files", "tokens") and not self.paths:
            raise ValueError(f"source '{self.source}' needs data.paths (files or globs)")
        if self.source == "hf":
            if not self.hf_dataset:
                raise ValueError("source 'hf' needs data.hf_dataset (a hub name, 'json' with paths, or a directory)")
            if self.shard_index is None:
                raise ValueError("source 'hf' needs data.shard_index (and num_shards): each peer streams its own "
                                 "disjoint part (data.hf_shard_by)")
        return self


@lru_cache(maxsize=1)
def embedded_tokens() -> np.ndarray:
    """The embedded corpus as byte tokens (~466k tokens of the Python Language Reference; see corpus/NOTICE)."""
    raw = resources.files("gasloc.peer.train").joinpath("corpus", EMBEDDED_CORPUS).read_bytes()
    return np.frombuffer(gzip.decompress(raw), dtype=np.uint8)


def _seed_of(*parts) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little") & (2**63 - 1)


def _check_ids(batch: np.ndarray, vocab_size: int | None, where: str) -> None:
    if vocab_size is not None and batch.size and int(batch.max()) >= vocab_size:
        raise ValueError(f"token id {int(batch.max())} in the {where} data is >= the tokenizer's vocabulary size "
                         f"{vocab_size}: the token shards were made with a different tokenizer than data.tokenizer")


class WindowSampler:
    """Random windows of T+1 tokens from a token array, restricted to some blocks of it.

    Batch n is a pure function of (seed, stream, n), so resuming needs only n: `state_dict() == {"batches": n}`.
    `tokens` is a NumPy array or a TokenSeq (several memory-mapped shards): only len() and indexing are used.
    """

    def __init__(self, tokens, blocks: np.ndarray, seq_len: int, batch_size: int, seed: int,
                 stream: str, vocab_size: int | None = None):
        self.tokens, self.blocks, self.vocab_size = tokens, blocks, vocab_size
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
        batch = self.tokens[idx]
        _check_ids(batch, self.vocab_size, "training")
        return torch.from_numpy(batch.astype(np.int64))

    def state_dict(self) -> dict:
        return {"batches": self.batches}

    def load_state_dict(self, state: dict) -> None:
        try:
            self.batches = int(state["batches"])
        except (KeyError, TypeError, ValueError):
            raise ValueError("saved data position has no batch count: did data.source change?") from None


class TokenData:
    """A worker's view of a token array: its training shard and the shared validation split (the tail)."""

    def __init__(self, tokens, cfg: DataConfig, seq_len: int, worker_seed: int | str = 0,
                 vocab_size: int | None = None):
        if len(tokens) < 4 * (seq_len + 1):
            raise ValueError(f"only {len(tokens)} tokens: too few for seq_len {seq_len}")
        self.cfg, self.seq_len, self.tokens, self.vocab_size = cfg, seq_len, tokens, vocab_size
        n_val = max(int(len(tokens) * cfg.val_fraction), 2 * (seq_len + 1))
        self.train_tokens, self.val_tokens = tokens[:len(tokens) - n_val], tokens[len(tokens) - n_val:]
        n_blocks = max(len(self.train_tokens) // BLOCK_TOKENS, 1)
        order = np.random.default_rng(_seed_of(cfg.seed, "shuffle")).permutation(n_blocks)
        if cfg.shard_index is None:
            blocks, stream = order, f"worker-{worker_seed}"
        else:  # disjoint: shard s owns blocks order[s], order[s + S], ...
            blocks, stream = order[cfg.shard_index::cfg.num_shards], f"shard-{cfg.shard_index}"
        self.train = WindowSampler(self.train_tokens, np.sort(blocks), seq_len, cfg.batch_size, cfg.seed, stream,
                                   vocab_size)

    def next_batch(self) -> torch.Tensor:
        return self.train.next_batch()

    def val_batches(self) -> list[torch.Tensor]:
        """The same validation batches for every worker and every call (evenly spaced windows)."""
        span = self.seq_len + 1
        n = self.cfg.val_batches * self.cfg.batch_size
        starts = np.linspace(0, len(self.val_tokens) - span, n).astype(np.int64)
        windows = self.val_tokens[starts[:, None] + np.arange(span)[None, :]]
        _check_ids(windows, self.vocab_size, "validation")
        return list(torch.from_numpy(windows.astype(np.int64)).split(self.cfg.batch_size))

    def state_dict(self) -> dict:
        return self.train.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.train.load_state_dict(state)


def tokenize_docs(docs, tok, chunk: int = ENCODE_CHUNK_DOCS):
    """Yield token arrays (separator included) for an iterable of texts, tokenizing `chunk` documents per call."""
    batch: list[str] = []
    for text in docs:
        batch.append(text)
        if len(batch) == chunk:
            yield from tok.encode_docs(batch)
            batch = []
    if batch:
        yield from tok.encode_docs(batch)


def tokens_from_files(cfg: DataConfig, tok) -> np.ndarray:
    """Every document of the files named by cfg.paths, tokenized and concatenated in path order."""
    from gasloc.peer.train.sources import TEXT_SUFFIXES, expand_paths, iter_file_docs

    parts, empty = [], []
    files = expand_paths(cfg.paths, TEXT_SUFFIXES, "text (.txt/.jsonl)")
    for path in files:
        ids = list(tokenize_docs(iter_file_docs(path, cfg.text_field), tok))
        if not ids:
            empty.append(path)
            log.warning("data_file_empty path=%s", path)
        parts += ids
    if not parts:
        raise ValueError(f"data.paths: {files[0]} is empty (no text)" if len(files) == 1 else
                         f"data.paths: all {len(files)} files are empty (no text), e.g. {files[0]}")
    return np.concatenate(parts).astype(token_dtype(tok.vocab_size))


def tokens_from_shards(cfg: DataConfig, tok):
    """A TokenSeq over the memory-mapped shards named by cfg.paths, checked against the tokenizer."""
    from gasloc.peer.train.sources import TOKEN_SUFFIXES, TokenSeq, expand_paths, open_token_shard

    arrays = []
    for path in expand_paths(cfg.paths, TOKEN_SUFFIXES, "token shard (.bin/.npy)"):
        arr, header = open_token_shard(path)
        vocab = header.get("vocab_size")
        if vocab is not None and vocab != tok.vocab_size:
            raise ValueError(f"{path} was tokenized with {header.get('tokenizer')!r} (vocabulary {vocab}) but "
                             f"data.tokenizer={cfg.tokenizer!r} has {tok.vocab_size}: use the same tokenizer")
        arrays.append(arr)
    seq = TokenSeq(arrays)
    if len(seq) == 0:
        raise ValueError(f"data.paths: the token shards {cfg.paths} are empty")
    return seq


@lru_cache(maxsize=2)
def _embedded_for(tokenizer: str) -> np.ndarray:
    tok = load_tokenizer(tokenizer)
    return tok.encode_docs([embedded_tokens().tobytes().decode("utf-8")])[0]


def build_data(cfg: DataConfig, seq_len: int, worker_seed: int | str = 0):
    """The data source and tokenizer named by `cfg`: (TokenData or StreamData, ByteTokenizer or HFTokenizer).

    Raises ValueError with one line (missing path, empty files, unknown tokenizer, bad shard, ...).
    """
    tok = load_tokenizer(cfg.tokenizer)
    if cfg.source == "hf":
        from gasloc.peer.train.hfdata import StreamData, open_hf_stream
        return StreamData(partial(open_hf_stream, cfg), tok, cfg, seq_len), tok
    if cfg.source == "embedded":
        tokens = embedded_tokens() if isinstance(tok, ByteTokenizer) else _embedded_for(cfg.tokenizer)
    elif cfg.source == "files":
        tokens = tokens_from_files(cfg, tok)
    else:
        tokens = tokens_from_shards(cfg, tok)
    return TokenData(tokens, cfg, seq_len, worker_seed, vocab_size=tok.vocab_size), tok


def private_batches(data, n: int) -> list[torch.Tensor]:
    """`n` batches that only this peer knows, for judging another peer's model (a donor's state, a partner's
    offer). The validation batches are the same for every peer (`val_batches`), so a hostile peer can tune a state
    to pass a check made on them; these are windows of our own training data at offsets drawn from the OS's
    randomness, new at every call, so nobody can know them in advance (nor can we: no seed is kept).

    A token array (embedded, files, tokens): random windows of our training blocks (a stream of its own; our
    training position does not move). A streamed dataset (hf) cannot be sampled at random: the next `n` batches of
    our own shard's stream, which training then skips (a few batches per check)."""
    if n <= 0:
        return []
    train = getattr(data, "train", None)
    if isinstance(train, WindowSampler):
        sampler = WindowSampler(train.tokens, train.blocks, train.seq_len, train.batch_size,
                                seed=secrets.randbits(63), stream="private-check", vocab_size=train.vocab_size)
        return [sampler.next_batch() for _ in range(n)]
    return [data.next_batch() for _ in range(n)]


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[torch.Tensor], autocast=None) -> float:
    """Mean validation loss (nats/token) of `model` over `batches` (under `autocast`, e.g. autocast_for(device))."""
    import contextlib

    was_training = model.training
    model.eval()
    dev = next(model.parameters()).device
    with autocast or contextlib.nullcontext():
        total = sum(float(model.loss(b.to(dev))) for b in batches) / len(batches)
    model.train(was_training)
    return total
