"""The run fingerprint: one hash of everything two peers must share for their tensors to mean the same thing.

It travels in every DHT record and exchange header (a mismatch is BAD_FINGERPRINT) and is stored in checkpoints (a
checkpoint of another configuration is skipped). Covered: protocol version, model shape (preset, seq_len, rope,
every parameter's shape), the tokenizer's identity (name, vocabulary size, vocabulary hash: two 32k tokenizers
must not mix), the algorithm and form, the mixing weight and mix momentum (unequal mixing weights on the two sides
of a pair break the mean preservation), and the seed of the initial model.
"""
from __future__ import annotations

import torch

from gasloc.peer.train.tokenizer import tokenizer_identity
from gasloc.protocol.messages import PROTOCOL_VERSION, fingerprint


def run_fingerprint(cfg, model: torch.nn.Module, tok) -> str:
    """`cfg`: a PeerConfig; `tok`: the tokenizer the data was built with."""
    m, o = cfg.model, cfg.outer
    gossiping = o.algorithm in ("gasloc", "gossip")
    return fingerprint(
        protocol=PROTOCOL_VERSION, preset=m.preset, seq_len=m.seq_len, rope_theta=m.rope_theta,
        shapes=[list(p.shape) for p in model.parameters()], tokenizer=tokenizer_identity(tok),
        algorithm=o.algorithm, form=o.form if gossiping else None, mix_weight=o.mix_weight if gossiping else None,
        mix_momentum=o.mix_momentum if gossiping else None, seed=cfg.run.seed)
