"""Streaming Hugging Face `datasets` (e.g. FineWeb-Edu) as resumable per-peer token batches.

Sharding (data.hf_shard_by), the same on every machine either way:
- by file: `IterableDataset.shard(num_shards, shard_index, contiguous=True)` gives each shard a contiguous run of
  the dataset's files and the peer opens only those, so it downloads about 1/num_shards of the data (FineWeb-Edu's
  sample-10BT has 14 parquet files of ~2 GB: reading the whole stream to keep 1/64 of it was 64x the traffic).
  Shards differ in size by up to one file. Without a validation split, the first val_docs documents of the
  stream lie in shard 0's first file(s) and shard 0 skips them.
- by document: document i of the stream (counted from 0 in every epoch, after the validation documents when there
  is no separate validation split) belongs to shard (i - val_docs) mod num_shards. Every peer reads the whole
  stream and tokenizes only its own documents: any file count works, at num_shards times the download.
Document indices below count within the stream the peer reads (its files, or the whole stream).

Position: the first document not yet fully consumed (its index, and the `datasets` iterator state just before it)
plus an offset into its tokens. Resuming loads that iterator state (datasets skips to it within one file), checks that
the document index matches, re-tokenizes that one document and drops `offset` tokens: the next batch is exactly the
one an uninterrupted reader would have produced.
"""
from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterator

import numpy as np
import torch

log = logging.getLogger(__name__)

ENCODE_CHUNK_DOCS = 64  # documents tokenized per encode_batch call
MAX_VAL_DOCS = 10_000   # a separate validation split is read up to this many documents (or enough tokens)


def open_hf_stream(cfg, split: str):
    """`datasets.load_dataset(..., streaming=True)` for `cfg` (a DataConfig); one-line ValueError on failure."""
    try:
        import datasets
    except ImportError:
        raise ValueError("data.source='hf' needs the datasets package: pip install 'gasloc[hf]'") from None
    kwargs: dict = {"split": split, "streaming": True}
    if cfg.paths:
        from gasloc.peer.train.sources import expand_paths
        kwargs["data_files"] = [str(p) for p in expand_paths(cfg.paths, ("",), "data")]
    try:
        return datasets.load_dataset(cfg.hf_dataset, cfg.hf_config, **kwargs)
    # datasets raises many types here (FileNotFoundError, DatasetNotFoundError, ValueError, ...): all mean "cannot open"
    except Exception as e:  # noqa: BLE001
        reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise ValueError(f"cannot open Hugging Face dataset {cfg.hf_dataset!r} (config {cfg.hf_config!r}, split "
                         f"{split!r}): {reason}") from None


def _text_of(example: dict, field: str, index: int) -> str:
    if field not in example:
        raise ValueError(f"document {index} of the dataset has no field {field!r} (set data.text_field; it has "
                         f"{', '.join(sorted(example))[:120]})")
    text = example[field]
    if not isinstance(text, str):
        raise ValueError(f"document {index}: field {field!r} is not a string")
    return text


class StreamData:
    """One peer's shard of a streamed dataset: `next_batch()` gives [B, T+1] int64 batches of consecutive text.

    Rows of a batch overlap by one token (row r is tokens[rT : rT + T + 1]) so every token is predicted once.
    """

    def __init__(self, open_stream: Callable[[str], object], tokenizer, cfg, seq_len: int):
        if cfg.shard_index is None:
            raise ValueError("data.source='hf' needs data.shard_index (and data.num_shards)")
        self.open_stream, self.tok, self.cfg, self.seq_len = open_stream, tokenizer, cfg, seq_len
        self.by_file = self._by_file(open_stream(cfg.hf_split))
        held_out = 0 if cfg.hf_val_split else cfg.hf_val_docs
        # by file, only shard 0's stream begins with the held-out documents
        self.skip = held_out if not self.by_file or cfg.shard_index == 0 else 0
        self.batches = 0
        self._val: list[torch.Tensor] | None = None
        self._restart(epoch=0, doc=0, hf_state=None, offset=0)

    def _by_file(self, ds) -> bool:
        """Whether this run shards by file (see the module docstring); a one-line ValueError when data.hf_shard_by
        asks for files the dataset does not have."""
        cfg = self.cfg
        files = getattr(ds, "num_shards", 1) or 1
        if cfg.hf_shard_by == "file" and files < cfg.num_shards:
            raise ValueError(f"data.hf_shard_by='file' needs at least num_shards={cfg.num_shards} files, but "
                             f"{cfg.hf_dataset!r} streams from {files}: use fewer shards or hf_shard_by='document'")
        by_file = cfg.hf_shard_by == "file" or (cfg.hf_shard_by == "auto" and files >= cfg.num_shards > 1)
        if cfg.num_shards > 1 and not by_file:
            log.warning("data_shard_by=document files=%d num_shards=%d: every peer reads the whole stream and keeps "
                        "1/%d of it", files, cfg.num_shards, cfg.num_shards)
        else:
            log.info("data_shard_by=%s files=%d num_shards=%d", "file" if by_file else "none", files, cfg.num_shards)
        return by_file

    def _stream(self):
        """The stream this peer reads: its own files, or the whole split."""
        ds = self.open_stream(self.cfg.hf_split)
        if self.by_file:
            ds = ds.shard(num_shards=self.cfg.num_shards, index=self.cfg.shard_index, contiguous=True)
        return ds

    # ---- the document stream
    def _my_docs(self, epoch: int, doc: int, hf_state: dict | None) -> Iterator[tuple[int, int, dict | None, str]]:
        """(epoch, index, iterator state before it, text) of this shard's documents, from document `doc` on."""
        ds = self._stream()
        if hf_state is not None:
            ds.load_state_dict(hf_state)
        it, i = iter(ds), doc
        n, s = (1, 0) if self.by_file else (self.cfg.num_shards, self.cfg.shard_index)
        while True:
            mine = i >= self.skip and (i - self.skip) % n == s
            before = ds.state_dict() if mine else None
            try:
                example = next(it)
            except StopIteration:
                return
            if mine:
                text = _text_of(example, self.cfg.text_field, i)
                if text:
                    yield epoch, i, before, text
            i += 1

    def _restart(self, epoch: int, doc: int, hf_state: dict | None, offset: int) -> None:
        self.epoch = epoch
        self._docs = self._my_docs(epoch, doc, hf_state)
        self._yielded_this_epoch = doc > 0
        self._buf: deque[tuple[int, int, dict | None, np.ndarray]] = deque()
        self._buffered = 0
        self._offset = 0
        self._pending = (doc, offset) if hf_state is not None or doc or offset else None
        self._start = {"epoch": epoch, "doc": doc, "offset": offset, "hf_state": hf_state}

    def _fill(self, need: int) -> None:
        while self._buffered - self._offset < need:
            chunk = []
            for item in self._docs:
                chunk.append(item)
                if len(chunk) == ENCODE_CHUNK_DOCS:
                    break
            if not chunk:  # end of the stream: start the next epoch from its beginning
                if not self._yielded_this_epoch:
                    raise ValueError(f"shard {self.cfg.shard_index} of {self.cfg.num_shards} of "
                                     f"{self.cfg.hf_dataset!r} has no documents: use fewer shards")
                log.info("data_epoch_done epoch=%d shard=%d", self.epoch, self.cfg.shard_index)
                self.epoch += 1
                self._docs = self._my_docs(self.epoch, 0, None)
                self._yielded_this_epoch = False
                continue
            self._yielded_this_epoch = True
            for (ep, i, st, _), ids in zip(chunk, self.tok.encode_docs([c[3] for c in chunk])):
                self._buf.append((ep, i, st, ids))
                self._buffered += len(ids)
            if self._pending is not None:  # first fill after a resume: land exactly on the saved position
                doc, offset = self._pending
                self._pending = None
                if self._buf[0][1] != doc or len(self._buf[0][3]) <= offset:
                    raise ValueError(f"saved data position (document {doc}, offset {offset}) does not match the "
                                     f"dataset (found document {self._buf[0][1]}): did the data or its config change?")
                self._offset = offset

    def next_batch(self) -> torch.Tensor:
        b, t = self.cfg.batch_size, self.seq_len
        need = b * t + 1
        self._fill(need)
        parts, got, skip = [], 0, self._offset
        for _, _, _, ids in self._buf:
            parts.append(ids[skip:skip + need - got])
            got += len(parts[-1])
            skip = 0
            if got >= need:
                break
        flat = np.concatenate(parts).astype(np.int64)
        rows = np.arange(b)[:, None] * t + np.arange(t + 1)[None, :]
        self._offset += b * t
        while self._buf and self._offset >= len(self._buf[0][3]):  # drop documents fully consumed
            self._offset -= len(self._buf[0][3])
            self._buffered -= len(self._buf[0][3])
            self._buf.popleft()
        self.batches += 1
        return torch.from_numpy(flat[rows])

    # ---- resumable position
    def state_dict(self) -> dict:
        if self._buf:  # after a batch the front document always has unread tokens (a batch reads one extra)
            ep, i, st, _ = self._buf[0]
            pos = {"epoch": ep, "doc": i, "offset": self._offset, "hf_state": st}
        else:  # nothing read yet: the position the reader was started (or resumed) at
            pos = dict(self._start)
        return {**pos, "batches": self.batches, "shard_by": "file" if self.by_file else "document"}

    def load_state_dict(self, state: dict) -> None:
        try:
            epoch, doc, offset = int(state["epoch"]), int(state["doc"]), int(state["offset"])
            hf_state, batches = state["hf_state"], int(state["batches"])
        except (KeyError, TypeError, ValueError):
            raise ValueError("saved data position is not a streaming ('hf') position: did data.source change?") \
                from None
        # positions count documents within the stream read: one of a file shard means nothing in the whole stream
        saved = state.get("shard_by", "document")
        if saved != ("file" if self.by_file else "document"):
            raise ValueError(f"saved data position was taken sharding by {saved}, this run shards by "
                             f"{'file' if self.by_file else 'document'}: set data.hf_shard_by = {saved!r}")
        self._restart(epoch, doc, hf_state, offset)
        self.batches = batches

    # ---- validation: the same batches for every peer
    def val_batches(self) -> list[torch.Tensor]:
        if self._val is None:
            self._val = self._build_val()
        return self._val

    def _build_val(self) -> list[torch.Tensor]:
        b, span = self.cfg.batch_size, self.seq_len + 1
        n = self.cfg.val_batches * b
        want = n * self.seq_len + 1
        split = self.cfg.hf_val_split or self.cfg.hf_split
        limit = MAX_VAL_DOCS if self.cfg.hf_val_split else self.cfg.hf_val_docs
        parts, got, texts = [], 0, []
        for i, example in enumerate(self.open_stream(split)):
            if i >= limit or got >= want:
                break
            texts.append(_text_of(example, self.cfg.text_field, i))
            if len(texts) == ENCODE_CHUNK_DOCS:
                parts += self.tok.encode_docs(texts)
                got, texts = sum(len(p) for p in parts), []
        if texts:
            parts += self.tok.encode_docs(texts)
        ids = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        if len(ids) < span:
            raise ValueError(f"the validation documents of {self.cfg.hf_dataset!r} hold {len(ids)} tokens, fewer "
                             f"than one sequence ({span}): raise data.hf_val_docs or set data.hf_val_split")
        # evenly spaced windows: disjoint when there is enough text, overlapping otherwise
        starts = np.linspace(0, len(ids) - span, n).astype(np.int64)
        windows = ids[starts[:, None] + np.arange(span)[None, :]].astype(np.int64)
        return list(torch.from_numpy(windows).split(b))
