"""Crash-safe checkpoints: parameters, inner AdamW state, outer state, data position and round, in one directory.

Layout under CheckpointConfig.dir:
    ckpt-<round:08d>-<time_ns>/state.safetensors   model.<name>, inner.<param index>.<key>, outer.<name>.<i>
    ckpt-<round:08d>-<time_ns>/meta.json           format, version, round, fingerprint, sha256 and size of the
                                                   safetensors file, data_state, meta, model shape, optimizer groups
A checkpoint is written into `.tmp-...` (each file fsynced), then renamed to its final name (the commit point),
then the parent directory is fsynced. A kill at any moment leaves either the previous checkpoints only or the new one
complete; a leftover `.tmp-...` is reported and removed by the next save. Loading verifies the JSON, the format
version, the size and sha256 of the tensors, the config fingerprint and that every value is finite, and validates
every shape before it touches the model, so a bad checkpoint is skipped (reason logged) and the next older one is
tried. A state with a NaN or Inf value is never written (CheckpointError).

Save only between rounds (after `outer.apply`): the outer anchor is not stored, it is restored as the parameters.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field

from gasloc.protocol.messages import fingerprint

log = logging.getLogger(__name__)

FORMAT = "gasloc-checkpoint"
VERSION = 1
STATE_FILE = "state.safetensors"
META_FILE = "meta.json"
_NAME = re.compile(r"^ckpt-(\d{8,})-(\d+)$")
_LEFTOVER = re.compile(r"^\.(tmp|del)-ckpt-")


class CheckpointConfig(BaseModel):
    """Periodic checkpoints of this peer, and resuming from them."""
    model_config = ConfigDict(extra="forbid")

    dir: Path | None = Field(None, description="directory of this peer's checkpoints (one peer per directory); "
                             "unset: the daemon's default under the run directory")
    every_rounds: int = Field(10, ge=1, description="write a checkpoint every this many outer rounds (and on "
                              "shutdown)")
    keep: int = Field(3, ge=1, description="how many of the newest checkpoints to keep")


class CheckpointError(ValueError):
    """Why one checkpoint cannot be used (one line)."""


@dataclass
class Loaded:
    round: int
    data_state: dict
    meta: dict
    path: Path
    skipped: list[tuple[Path, str]] = field(default_factory=list)


def config_fingerprint(*parts) -> str:
    """A short stable hash of JSON-able parts (pydantic models are dumped): equal configs, equal fingerprints."""
    norm = [p.model_dump(mode="json") if isinstance(p, BaseModel) else p for p in parts]
    return fingerprint(parts=norm)  # the one hash of protocol/messages.py


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- flattening model / optimizer / outer state into named CPU tensors

def _flatten(model: torch.nn.Module, inner_opt: torch.optim.Optimizer, outer, copy: bool = True
             ) -> tuple[dict, dict]:
    # copy False: CPU tensors as they are (no copy when contiguous); the caller writes before it changes them
    def host(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu", copy=copy).contiguous()

    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, t in model.state_dict().items():
        key = (t.device, t.data_ptr(), t.shape, t.dtype)
        if t.numel() and key in seen:  # tied weights (lm_head = embed_tokens): stored once, restored twice
            aliases[name] = seen[key]
            continue
        seen[key] = name
        tensors[f"model.{name}"] = host(t)
    opt = inner_opt.state_dict()
    scalars: dict[str, object] = {}
    for idx, st in opt["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"inner.{idx}.{k}"] = host(v)
            else:
                scalars[f"{idx}.{k}"] = v
    for name, t in outer.state_dict().items():
        tensors[f"outer.{name}"] = host(t)
    groups = [dict(g) for g in opt["param_groups"]]
    record = {"aliases": aliases, "inner": {"param_groups": groups, "scalars": scalars}}
    return tensors, record


def _restore(tensors: dict, record: dict, model: torch.nn.Module, inner_opt: torch.optim.Optimizer, outer) -> None:
    """Validate everything first, then load: a checkpoint that does not fit leaves model, optimizer and outer as
    they were."""
    current = model.state_dict()
    full = {n: tensors.get(f"model.{record['aliases'].get(n, n)}") for n in current}
    for n, t in current.items():
        got = full[n]
        if got is None or got.shape != t.shape or got.dtype != t.dtype:
            raise CheckpointError(f"model tensor {n} is missing or has another shape/dtype "
                                  f"({None if got is None else (tuple(got.shape), got.dtype)} vs "
                                  f"{(tuple(t.shape), t.dtype)})")
    extra = {k[6:] for k in tensors if k.startswith("model.")} - set(current)
    if extra:
        raise CheckpointError(f"checkpoint has model tensors this model lacks, e.g. {sorted(extra)[0]}")
    groups = record["inner"]["param_groups"]
    mine = inner_opt.state_dict()["param_groups"]
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in mine]:
        raise CheckpointError("inner optimizer has another parameter layout")
    params = [p for g in inner_opt.param_groups for p in g["params"]]
    state: dict[int, dict] = {}
    for key, t in tensors.items():
        if key.startswith("inner."):
            _, idx, name = key.split(".", 2)
            state.setdefault(int(idx), {})[name] = t
    for key, v in record["inner"]["scalars"].items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = v
    for idx, st in state.items():
        if idx >= len(params):
            raise CheckpointError(f"inner optimizer state for parameter {idx} of {len(params)}")
        for name, t in st.items():
            if torch.is_tensor(t) and t.dim() and t.shape != params[idx].shape:
                raise CheckpointError(f"inner optimizer {name} of parameter {idx} has shape {tuple(t.shape)}")
    want_outer = outer.state_dict()
    got_outer = {k[6:]: t for k, t in tensors.items() if k.startswith("outer.")}
    if set(got_outer) != set(want_outer) or any(got_outer[k].shape != v.shape for k, v in want_outer.items()):
        raise CheckpointError(f"outer state does not fit this outer update ({type(outer).__name__}): "
                              f"{sorted(set(got_outer) ^ set(want_outer))[:3] or 'shape mismatch'}")
    # JSON turned tuples (betas) into lists; AdamW unpacks either, but keep the types it was saved with
    groups = [{k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in g.items()} for g in groups]
    with torch.no_grad():
        model.load_state_dict(full, strict=True)
        inner_opt.load_state_dict({"state": state, "param_groups": groups})
        outer.load_state_dict(got_outer, list(model.parameters()))


def _model_record(model: torch.nn.Module) -> dict:
    """What `gasloc export` needs to rebuild the model without the peer's config."""
    out: dict = {"class": type(model).__name__}
    cfg, preset, vocab = getattr(model, "cfg", None), getattr(model, "preset", None), getattr(model, "vocab_size", None)
    if isinstance(cfg, BaseModel):
        out["config"] = cfg.model_dump(mode="json")
    if preset is not None:
        out["preset"] = asdict(preset)
    if vocab is not None:
        out["vocab_size"] = int(vocab)
    return out


# ---- writing

def _clean_leftovers(root: Path) -> None:
    """Remove the temporary and half-deleted directories of saves that died.

    Saves are sequential and there is one writer per directory (the daemon holds a lock on its run directory), so a
    leftover here is never a save in progress. Pids are not checked: in a container the restarted peer often has
    the same pid as the one that died.
    """
    for p in root.iterdir():
        if _LEFTOVER.match(p.name):
            log.info("checkpoint_leftover_removed path=%s", p)
            shutil.rmtree(p, ignore_errors=True)


def _committed(root: Path) -> list[tuple[int, int, Path]]:
    out = []
    for p in root.iterdir():
        m = _NAME.match(p.name)
        if m and p.is_dir():
            out.append((int(m.group(1)), int(m.group(2)), p))
    return sorted(out, reverse=True)


def _prune(root: Path, keep: int) -> None:
    for _, _, p in _committed(root)[keep:]:
        # rename first so a kill mid-delete never leaves a half-deleted directory under a checkpoint name
        doomed = root / f".del-{p.name}-{os.getpid()}-{secrets.token_hex(4)}"
        os.rename(p, doomed)
        shutil.rmtree(doomed, ignore_errors=True)


@dataclass
class Staged:
    """A checkpoint's contents copied to host memory (`stage`), ready to be written by another thread while
    training goes on with the live tensors."""
    tensors: dict[str, torch.Tensor]
    record: dict
    round: int


def stage(*, model: torch.nn.Module, inner_opt: torch.optim.Optimizer, outer, data_state: dict, round: int,
          meta: dict, fingerprint: str | None = None, copy: bool = True) -> Staged:
    """Copy what a checkpoint holds (on the training thread, at a round boundary: a consistent state); the slow
    part (finite check, safetensors, sha256, fsync) is `write_staged`'s. `copy` False: the state's CPU tensors
    themselves, not copies (a CPU peer: the copy is 4 parameter copies on top of a round's peak), valid only until
    training changes them, so the caller waits for the write."""
    fp = fingerprint if fingerprint is not None else meta.get("fingerprint")
    if not isinstance(fp, str) or not fp:
        raise ValueError("save_checkpoint needs the config fingerprint (fingerprint= or meta['fingerprint'])")
    tensors, record = _flatten(model, inner_opt, outer, copy)
    record.update({"format": FORMAT, "version": VERSION, "round": int(round), "fingerprint": fp,
                   "created_unix": time.time(), "data_state": data_state, "meta": meta,
                   "model": _model_record(model), "outer": {"class": type(outer).__name__}})
    try:
        json.dumps(record)
    except (TypeError, ValueError) as e:
        raise ValueError(f"checkpoint data_state/meta must be JSON-able: {e}") from None
    return Staged(tensors, record, int(round))


def save_checkpoint(cfg: CheckpointConfig, *, model: torch.nn.Module, inner_opt: torch.optim.Optimizer, outer,
                    data_state: dict, round: int, meta: dict, fingerprint: str | None = None) -> Path:
    """Write one checkpoint atomically and keep the newest `cfg.keep`; returns its directory.

    `fingerprint` (or meta["fingerprint"]) is compared by load_latest; meta is any JSON-able dict (the daemon puts
    e.g. {"tokenizer": ..., "inner_step": ...} there; `gasloc export` reads meta["tokenizer"]).
    """
    return write_staged(cfg, stage(model=model, inner_opt=inner_opt, outer=outer, data_state=data_state,
                                   round=round, meta=meta, fingerprint=fingerprint))


def write_staged(cfg: CheckpointConfig, staged: Staged) -> Path:
    """The I/O half of save_checkpoint: refuse a non-finite state, write into a temporary folder, fsync, rename
    (the commit point), prune. Safe to run off the training thread: it reads only `staged`."""
    from safetensors.torch import save_file

    if cfg.dir is None:
        raise ValueError("checkpoint.dir is not set")
    root = Path(cfg.dir)
    root.mkdir(parents=True, exist_ok=True)
    _clean_leftovers(root)
    tensors, record, round = staged.tensors, dict(staged.record), staged.round
    bad = _first_non_finite(tensors)
    if bad is not None:  # a NaN checkpoint would be resumed on every restart: a crash loop
        raise CheckpointError(f"not written: tensor {bad} has NaN or Inf values")
    name = f"ckpt-{int(round):08d}-{time.time_ns()}"
    tmp = root / f".tmp-{name}-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        state_path = tmp / STATE_FILE
        save_file(tensors, str(state_path), metadata={"format": FORMAT})
        _fsync_path(state_path)
        record["files"] = {STATE_FILE: {"sha256": _sha256(state_path), "bytes": state_path.stat().st_size}}
        with (tmp / META_FILE).open("w") as f:
            json.dump(record, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync_path(tmp)
        final = root / name
        os.rename(tmp, final)  # the commit point
        _fsync_path(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _prune(root, cfg.keep)
    log.info("checkpoint_saved round=%d path=%s bytes=%d", round, final, record["files"][STATE_FILE]["bytes"])
    return final


class CheckpointWriter:
    """Writes staged checkpoints on one background thread, in order, one at a time: the training thread pays for
    the copy only (`stage`), not for serializing, hashing and fsyncing. `flush()` waits for the write in flight
    (before loading a checkpoint, and at shutdown). A failed write is logged and reported to `done` as an error;
    the older checkpoints stay the newest valid ones."""

    def __init__(self):
        import concurrent.futures

        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self._last = None

    def submit(self, cfg: CheckpointConfig, staged: Staged, done) -> None:
        """Write `staged`; then call done(path, None) or done(None, error) on the writer thread."""
        self.flush()  # one in flight at most: a slow disk holds back the next save, not memory

        def write() -> None:
            try:
                path = write_staged(cfg, staged)
            except (CheckpointError, OSError, ValueError) as e:
                done(None, e)
                return
            done(path, None)

        self._last = self._pool.submit(write)

    def flush(self) -> None:
        if self._last is not None:
            self._last.result()
            self._last = None

    def close(self) -> None:
        self.flush()
        self._pool.shutdown(wait=True)


# ---- reading

def read_checkpoint(path: Path, fingerprint: str | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """(meta.json record, tensors) of one checkpoint directory, verified; CheckpointError says why not."""
    from safetensors.torch import load_file

    try:
        record = json.loads((path / META_FILE).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"no {META_FILE}") from None
    except (ValueError, UnicodeDecodeError):
        raise CheckpointError(f"{META_FILE} is not valid JSON (truncated or corrupt)") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise CheckpointError(f"{META_FILE} is not a {FORMAT} record")
    if record.get("version") != VERSION:
        raise CheckpointError(f"format version {record.get('version')} (this gasloc reads {VERSION})")
    if fingerprint is not None and record.get("fingerprint") != fingerprint:
        raise CheckpointError(f"config fingerprint {record.get('fingerprint')} differs from this run's "
                              f"{fingerprint} (model, tokenizer, algorithm, mixing or protocol version changed)")
    try:
        info = record["files"][STATE_FILE]
        expected_sha, expected_bytes = str(info["sha256"]), int(info["bytes"])
        for k in ("round", "data_state", "meta", "aliases", "inner"):
            record[k]
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{META_FILE} lacks required fields") from None
    state_path = path / STATE_FILE
    if not state_path.is_file():
        raise CheckpointError(f"{STATE_FILE} is missing")
    size = state_path.stat().st_size
    if size != expected_bytes:
        raise CheckpointError(f"{STATE_FILE} has {size} bytes, expected {expected_bytes} (truncated)")
    if _sha256(state_path) != expected_sha:
        raise CheckpointError(f"{STATE_FILE} checksum mismatch (corrupt)")
    try:
        tensors = load_file(str(state_path))
    except Exception as e:  # safetensors raises its own error type for any malformed file  # noqa: BLE001
        raise CheckpointError(f"{STATE_FILE} cannot be read: {str(e).splitlines()[0][:120]}") from None
    bad = _first_non_finite(tensors)
    if bad is not None:
        raise CheckpointError(f"tensor {bad} has NaN or Inf values (written by an older gasloc or by hand)")
    return record, tensors


def _first_non_finite(tensors: dict[str, torch.Tensor]) -> str | None:
    """The name of the first floating-point tensor with a NaN or Inf value, or None."""
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return name
    return None


def scan(root: Path | None, fingerprint: str | None = None):
    """Yield (path, record, tensors) of valid checkpoints newest first, and (path, reason) for skipped ones.

    Items are ("ok", path, record, tensors) or ("skip", path, reason).
    """
    if root is None or not Path(root).is_dir():
        return
    root = Path(root)
    for p in sorted(root.iterdir()):
        if _LEFTOVER.match(p.name) and p.name.startswith(".tmp-"):
            yield "skip", p, "incomplete write (temporary directory left by an interrupted save)"
    for _, _, p in _committed(root):
        try:
            record, tensors = read_checkpoint(p, fingerprint)
        except CheckpointError as e:
            yield "skip", p, str(e)
            continue
        yield "ok", p, record, tensors


def load_latest(cfg: CheckpointConfig, *, model: torch.nn.Module, inner_opt: torch.optim.Optimizer, outer,
                fingerprint: str) -> Loaded | None:
    """Restore the newest valid checkpoint into model, inner_opt and outer; None if there is none.

    Every checkpoint passed over is logged as a warning with its reason and listed in Loaded.skipped.
    """
    skipped: list[tuple[Path, str]] = []
    for item in scan(cfg.dir, fingerprint):
        if item[0] == "skip":
            _, p, reason = item
            log.warning("checkpoint_skipped path=%s reason=%s", p, reason)
            skipped.append((p, reason))
            continue
        _, p, record, tensors = item
        try:
            _restore(tensors, record, model, inner_opt, outer)
        except CheckpointError as e:
            log.warning("checkpoint_skipped path=%s reason=%s", p, e)
            skipped.append((p, str(e)))
            continue
        log.info("checkpoint_loaded round=%d path=%s skipped=%d", record["round"], p, len(skipped))
        return Loaded(int(record["round"]), record["data_state"], record["meta"], p, skipped)
    if skipped:
        log.warning("checkpoint_none_valid dir=%s skipped=%d", cfg.dir, len(skipped))
    return None
