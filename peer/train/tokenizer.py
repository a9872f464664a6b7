"""Tokenizers: UTF-8 bytes (the default, nothing to download) or a Hugging Face `tokenizers` tokenizer.

`load_tokenizer(spec)` takes "bytes", a path to a tokenizer.json (or a directory holding one), or a Hugging Face
hub model name (its tokenizer.json is fetched through huggingface_hub's cache, so HF_HUB_OFFLINE=1 works once it is
cached). Both kinds share one small interface: `vocab_size`, `eos_id`, `encode`, `encode_docs`, `decode`, `save`.
"""
from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

# Tried in this order when no tokenizer_config.json names the end-of-text token.
_EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")
BYTES_DOC_SEPARATOR = b"\n\n"  # the byte tokenizer has no special tokens: documents are joined by a blank line


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id of a vocabulary."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, nothing to download."""
    vocab_size = 256
    eos_id: int | None = None
    name = "bytes"

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def encode_docs(self, texts: list[str]) -> list[np.ndarray]:
        """Each document's tokens followed by the document separator (so concatenated documents stay apart)."""
        return [np.frombuffer(t.encode("utf-8") + BYTES_DOC_SEPARATOR, dtype=np.uint8) for t in texts]

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def save(self, out_dir: Path) -> None:
        """Write a Hugging Face tokenizer whose id for each byte is the byte's value (see `byte_level_tokenizer`)."""
        out_dir = Path(out_dir)
        byte_level_tokenizer().save(str(out_dir / "tokenizer.json"))
        _write_tokenizer_config(out_dir, eos_token=None)


class HFTokenizer:
    """A `tokenizers.Tokenizer` (fast, Rust) behind the same interface as ByteTokenizer."""

    def __init__(self, tok, name: str, source_file: Path | None = None, eos_token: str | None = None):
        self.tok, self.name, self.source_file = tok, name, source_file
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.eos_token = eos_token if eos_token and tok.token_to_id(eos_token) is not None else next(
            (c for c in _EOS_CANDIDATES if tok.token_to_id(c) is not None), None)
        self.eos_id = tok.token_to_id(self.eos_token) if self.eos_token else None
        self._dtype = token_dtype(self.vocab_size)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tok.encode(text, add_special_tokens=False).ids, dtype=self._dtype)

    def encode_docs(self, texts: list[str]) -> list[np.ndarray]:
        """Each document's tokens followed by the end-of-text token, if the tokenizer has one.

        encode_batch tokenizes in parallel threads (Rust), which keeps a streaming reader ahead of a fast GPU.
        """
        tail = [self.eos_id] if self.eos_id is not None else []
        return [np.asarray(e.ids + tail, dtype=self._dtype)
                for e in self.tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, out_dir: Path) -> None:
        out_dir = Path(out_dir)
        if self.source_file is not None:
            shutil.copyfile(self.source_file, out_dir / "tokenizer.json")
        else:
            self.tok.save(str(out_dir / "tokenizer.json"))
        _write_tokenizer_config(out_dir, eos_token=self.eos_token)


def tokenizer_identity(tok: ByteTokenizer | HFTokenizer) -> dict:
    """What identifies a tokenizer across machines: its name, vocabulary size and a hash of its vocabulary (token ->
    id, added tokens included). Two 32k tokenizers of different origin differ here; the same tokenizer loaded
    from the hub or from a local copy does not."""
    if isinstance(tok, ByteTokenizer):
        vocab = {"bytes": 256}
    else:
        vocab = tok.tok.get_vocab(with_added_tokens=True)
    blob = json.dumps(sorted(vocab.items()), separators=(",", ":"), ensure_ascii=False).encode()
    return {"name": tok.name, "vocab_size": int(tok.vocab_size), "vocab_sha256": hashlib.sha256(blob).hexdigest()}


def _write_tokenizer_config(out_dir: Path, eos_token: str | None) -> None:
    # PreTrainedTokenizerFast reads tokenizer.json as is; naming the class keeps AutoTokenizer from guessing one
    # from the model type (LlamaTokenizerFast would add a BOS token our model never saw).
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False, "add_eos_token": False}
    if eos_token:
        cfg["eos_token"] = eos_token
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def byte_level_tokenizer():
    """A `tokenizers.Tokenizer` equal to ByteTokenizer: id = byte value, no merges, no special tokens.

    ByteLevel pre-tokenization maps each byte to a printable stand-in character; the vocabulary maps that character
    back to the byte's value, so Hugging Face tools see the exported byte model with its real tokenizer.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    # ByteLevel's table: printable Latin-1 bytes stand for themselves, the others take the code points from 256 on
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    stand_in, extra = {}, 0
    for b in range(256):
        if b in printable:
            stand_in[chr(b)] = b
        else:
            stand_in[chr(256 + extra)] = b
            extra += 1
    tok = Tokenizer(models.BPE(vocab=stand_in, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def _from_file(path: Path, name: str) -> HFTokenizer:
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises a bare Exception for any parse error
        raise ValueError(f"tokenizer file {path} is not a valid tokenizer.json: {str(e).splitlines()[0]}") from None
    eos = None
    config = path.parent / "tokenizer_config.json"
    if config.is_file():
        try:
            eos = json.loads(config.read_text()).get("eos_token")
        except ValueError:
            eos = None
        eos = eos.get("content") if isinstance(eos, dict) else eos
    return HFTokenizer(tok, name, source_file=path, eos_token=eos)


def load_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    """'bytes', a tokenizer.json path, a directory holding tokenizer.json, or a hub model name."""
    if spec == "bytes":
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if path.is_file():
        return _from_file(path, spec)
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"tokenizer directory {path} has no tokenizer.json (only fast tokenizers are "
                             f"supported; save one with tokenizer.save_pretrained())")
        return _from_file(path / "tokenizer.json", spec)
    if spec.startswith((".", "/", "~")) or spec.endswith(".json"):
        raise ValueError(f"tokenizer path {spec} does not exist")
    try:
        from huggingface_hub import hf_hub_download
        cached = Path(hf_hub_download(spec, "tokenizer.json"))
    except ImportError:
        raise ValueError(f"unknown tokenizer {spec!r}: loading from the hub needs huggingface_hub "
                         f"(pip install 'gasloc[hf]')") from None
    except Exception as e:  # offline, no such repo, no tokenizer.json: all mean "cannot use this name"  # noqa: BLE001
        reason = str(e).splitlines()[0][:160]
        raise ValueError(f"unknown tokenizer {spec!r}: not a local path, and no tokenizer.json for it on the "
                         f"Hugging Face hub or in its cache ({type(e).__name__}: {reason}); use 'bytes', a path to "
                         f"tokenizer.json or a directory holding one") from None
    try:  # optional: names the end-of-text token; it lands beside tokenizer.json in the same cache snapshot
        hf_hub_download(spec, "tokenizer_config.json")
    except Exception as e:  # without it the EOS token is guessed from common names  # noqa: BLE001
        log.info("tokenizer_config_missing name=%s reason=%s", spec, type(e).__name__)
    return _from_file(cached, spec)
