"""Where documents and tokens come from: local text/JSONL files, pre-tokenized token shards, and the memory-mapped
view over several shards that the window sampler reads.

Token shard format (what `gasloc tokenize` writes; version 1):
    NAME.bin   the token ids, little-endian, uint16 (vocabulary <= 65536) or uint32, back to back; documents are
               separated by the tokenizer's end-of-text token (bytes: a blank line)
    NAME.json  sidecar: {"format": "gasloc-tokens", "version": 1, "dtype": "uint16", "num_tokens": N,
                         "vocab_size": V, "tokenizer": "bytes"}
A NumPy `.npy` file of uint16/uint32 ids is accepted too (its header gives the dtype; no sidecar needed).
"""
from __future__ import annotations

import glob
import gzip
import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

TOKENS_FORMAT = "gasloc-tokens"
TOKENS_VERSION = 1
TEXT_SUFFIXES = (".txt", ".txt.gz", ".jsonl", ".jsonl.gz")
TOKEN_SUFFIXES = (".bin", ".npy")


def expand_paths(patterns: list[str], suffixes: tuple[str, ...], what: str) -> list[Path]:
    """Files matched by glob patterns (sorted, each once); every pattern must match a file with a known suffix."""
    if not patterns:
        raise ValueError(f"data.paths is empty: give the {what} files (globs allowed)")
    out: list[Path] = []
    for pat in patterns:
        hits = sorted(glob.glob(os.path.expanduser(pat), recursive=True)) or ([pat] if Path(pat).exists() else [])
        files = [Path(h) for h in hits if Path(h).is_file()]
        if not files:
            raise ValueError(f"data.paths: {pat!r} matches no file")
        bad = [f for f in files if not f.name.endswith(suffixes)]
        if bad:
            raise ValueError(f"data.paths: {bad[0]} is not a {what} file (expected {', '.join(suffixes)})")
        out += [f for f in files if f not in out]
    return out


def _open_text(path: Path):
    return gzip.open(path, "rt", encoding="utf-8") if path.name.endswith(".gz") else path.open(encoding="utf-8")


def iter_file_docs(path: Path, text_field: str) -> Iterator[str]:
    """Documents of one file: a .txt file is one document; a .jsonl file has one JSON object per line."""
    try:
        with _open_text(path) as f:
            if ".txt" in path.name:
                text = f.read()
                if text:
                    yield text
                return
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except ValueError:
                    raise ValueError(f"{path}:{lineno} is not valid JSON") from None
                if not isinstance(obj, dict) or text_field not in obj:
                    raise ValueError(f"{path}:{lineno} has no field {text_field!r} (set data.text_field)")
                if not isinstance(obj[text_field], str):
                    raise ValueError(f"{path}:{lineno}: field {text_field!r} is not a string")
                if obj[text_field]:
                    yield obj[text_field]
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text") from None
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None


class TokenSeq:
    """Several 1-D token arrays (memory-mapped shards) seen as one, with the two operations the samplers use:
    `len()` and indexing by a slice (a view) or by an integer array (a gather that reads only the pages it needs).
    """

    def __init__(self, arrays: list[np.ndarray], start: int = 0, stop: int | None = None):
        self.arrays = [a for a in arrays if len(a)]
        self.offsets = np.cumsum([0] + [len(a) for a in self.arrays])
        self.start, self.stop = start, int(self.offsets[-1]) if stop is None else stop
        self.dtype = np.result_type(*[a.dtype for a in self.arrays]) if self.arrays else np.dtype(np.uint16)

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, key):
        if isinstance(key, slice):
            a, b, step = key.indices(len(self))
            if step != 1:
                raise IndexError("TokenSeq slices must be contiguous")
            return TokenSeq(self.arrays, self.start + a, self.start + max(a, b)) if self.arrays else self
        idx = np.asarray(key, dtype=np.int64) + self.start
        which = np.searchsorted(self.offsets, idx, side="right") - 1
        out = np.empty(idx.shape, dtype=self.dtype)
        for f in np.unique(which):
            mask = which == f
            out[mask] = self.arrays[f][idx[mask] - self.offsets[f]]
        return out


def _sidecar(path: Path) -> Path:
    return path.with_suffix(".json")


def open_token_shard(path: Path) -> tuple[np.ndarray, dict]:
    """Memory-map one shard; returns (ids, header). Raises ValueError with one line on any format problem."""
    if path.suffix == ".npy":
        try:
            arr = np.load(path, mmap_mode="r")
        except ValueError as e:
            raise ValueError(f"{path} is not a valid .npy file: {e}") from None
        if arr.ndim != 1 or arr.dtype not in (np.uint16, np.uint32):
            raise ValueError(f"{path}: expected a 1-D uint16 or uint32 array, got {arr.dtype} {arr.shape}")
        return arr, {"dtype": str(arr.dtype), "num_tokens": len(arr)}
    side = _sidecar(path)
    try:
        header = json.loads(side.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path} has no sidecar {side.name} (token shards are made by `gasloc tokenize`)") from None
    except ValueError:
        raise ValueError(f"{side} is not valid JSON") from None
    if header.get("format") != TOKENS_FORMAT or header.get("version") != TOKENS_VERSION:
        raise ValueError(f"{side}: not a {TOKENS_FORMAT} v{TOKENS_VERSION} header")
    if header.get("dtype") not in ("uint16", "uint32"):
        raise ValueError(f"{side}: dtype must be uint16 or uint32, got {header.get('dtype')!r}")
    dtype = np.dtype(header["dtype"]).newbyteorder("<")
    n = int(header.get("num_tokens", -1))
    size = path.stat().st_size
    if size != n * dtype.itemsize:
        raise ValueError(f"{path} holds {size} bytes but its header says {n} {header['dtype']} tokens "
                         f"(truncated or not written by gasloc tokenize)")
    if n == 0:
        return np.zeros(0, dtype=dtype), header
    return np.memmap(path, dtype=dtype, mode="r", shape=(n,)), header


class ShardWriter:
    """Appends token arrays to NAME-00000.bin, NAME-00001.bin, ... of at most `shard_tokens` tokens each.

    A shard appears under its final name only when complete (written to a temporary name, then renamed).
    """

    def __init__(self, out_dir: Path, vocab_size: int, tokenizer: str, shard_tokens: int, prefix: str = "tokens"):
        from gasloc.peer.train.tokenizer import token_dtype

        self.out_dir, self.vocab_size, self.tokenizer = Path(out_dir), vocab_size, tokenizer
        self.shard_tokens, self.prefix = shard_tokens, prefix
        self.dtype = token_dtype(vocab_size).newbyteorder("<")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.shards: list[Path] = []
        self.total = 0
        self._f, self._n = None, 0

    def _open(self) -> None:
        self._path = self.out_dir / f"{self.prefix}-{len(self.shards):05d}.bin"
        self._f, self._n = open(self._path.with_suffix(".bin.tmp"), "wb"), 0

    def _close(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        header = {"format": TOKENS_FORMAT, "version": TOKENS_VERSION, "dtype": self.dtype.name,
                  "num_tokens": self._n, "vocab_size": self.vocab_size, "tokenizer": self.tokenizer}
        _sidecar(self._path).write_text(json.dumps(header) + "\n")
        os.replace(self._path.with_suffix(".bin.tmp"), self._path)
        self.shards.append(self._path)
        self._f = None

    def write(self, ids: np.ndarray) -> None:
        ids = np.asarray(ids).astype(self.dtype, copy=False)
        while len(ids):
            if self._f is None:
                self._open()
            take = min(len(ids), self.shard_tokens - self._n)
            self._f.write(ids[:take].tobytes())
            self._n += take
            self.total += take
            ids = ids[take:]
            if self._n >= self.shard_tokens:
                self._close()

    def close(self) -> list[Path]:
        if self._f is not None:
            self._close()
        return self.shards
