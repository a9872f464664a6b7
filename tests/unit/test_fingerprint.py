"""The one run fingerprint (peer/fingerprint.py): it covers the tokenizer's identity and the mixing weight."""
from __future__ import annotations

from gasloc.peer.config import PeerConfig
from gasloc.peer.fingerprint import run_fingerprint
from gasloc.peer.train.model import build_model
from gasloc.peer.train.tokenizer import ByteTokenizer, HFTokenizer, byte_level_tokenizer, tokenizer_identity


def _fp(tok=None, **outer) -> str:
    cfg = PeerConfig.model_validate({"model": {"preset": "tiny", "seq_len": 32}, "outer": outer})
    tok = tok or ByteTokenizer()
    return run_fingerprint(cfg, build_model(cfg.model, tok.vocab_size, seed=0), tok)


def test_equal_configs_equal_fingerprints_and_the_mixing_weight_counts():
    assert _fp() == _fp()
    assert _fp(mix_weight=0.3) != _fp()
    assert _fp(mix_momentum=0.0) != _fp()


def test_two_tokenizers_of_one_vocabulary_size_differ():
    """Both have 256 tokens (the model shapes are equal): only the tokenizer's identity tells them apart."""
    hf = HFTokenizer(byte_level_tokenizer(), "byte-level-copy")
    assert hf.vocab_size == ByteTokenizer.vocab_size
    assert tokenizer_identity(hf)["vocab_sha256"] != tokenizer_identity(ByteTokenizer())["vocab_sha256"]
    assert _fp(hf) != _fp()
    # the same tokenizer under the same name: the same identity
    assert tokenizer_identity(HFTokenizer(byte_level_tokenizer(), "x")) == tokenizer_identity(
        HFTokenizer(byte_level_tokenizer(), "x"))
