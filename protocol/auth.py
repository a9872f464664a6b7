"""Private swarms: the shared swarm key and the proofs built from it. Sans-I/O: bytes and strings in, bytes out.

A swarm key is a text file holding at least KEY_MIN_BYTES random bytes as hex (`gasloc keygen` writes one). Peers
that share it prove so to each other without ever sending it:

- on our streams (exchange, state download) each side sends HMAC-SHA256(key, purpose | caller | callee). Transport
  security already authenticates both peer ids and encrypts the stream, so a proof bound to both ids cannot be
  used by anyone else: a third party never sees it, and the partner who sees it cannot be the caller (its
  transport id differs). That is what a challenge-response would buy, without its extra round trip;
- on the DHT's RPCs, a MAC over each request and response with a timestamp and a nonce (peer/swarm/private.py).
"""
from __future__ import annotations

import hashlib
import hmac
import string

KEY_MIN_BYTES = 32
PROOF_HEX_CHARS = 64            # a hex SHA-256 digest

# What a proof is for: a proof made for one purpose or direction is never accepted for another.
EXCHANGE_CALL, EXCHANGE_ANSWER = "exchange-call", "exchange-answer"
STATE_CALL, STATE_ANSWER = "state-call", "state-answer"


class SwarmKeyError(ValueError):
    """The key text is unusable; the message is one line that says why."""


def parse_swarm_key(text: str) -> bytes:
    """The key bytes from a key file's text: hex digits (whitespace and one optional trailing newline ignored),
    at least KEY_MIN_BYTES bytes."""
    digits = "".join(text.split())
    if not digits:
        raise SwarmKeyError("the swarm key file is empty (make one with `gasloc keygen FILE`)")
    if any(c not in string.hexdigits for c in digits) or len(digits) % 2:
        raise SwarmKeyError("the swarm key file must hold hex digits only (make one with `gasloc keygen FILE`)")
    key = bytes.fromhex(digits)
    if len(key) < KEY_MIN_BYTES:
        raise SwarmKeyError(f"the swarm key has {len(key)} bytes, at least {KEY_MIN_BYTES} are needed "
                            f"(make one with `gasloc keygen FILE`)")
    if len(set(key)) == 1:
        raise SwarmKeyError("the swarm key is one byte repeated: not random (make one with `gasloc keygen FILE`)")
    return key


def stream_proof(key: bytes, purpose: str, caller: str, callee: str) -> str:
    """Proof that the sender holds `key`, for one purpose and one ordered pair of peer ids (base58)."""
    msg = "\n".join(("gasloc-swarm-proof-v1", purpose, caller, callee)).encode()
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def proof_ok(key: bytes | None, proof: str, purpose: str, caller: str, callee: str) -> bool:
    """Whether `proof` is the right one; with no key (an open swarm) every proof, also none, passes."""
    if key is None:
        return True
    if not isinstance(proof, str) or len(proof) != PROOF_HEX_CHARS:
        return False
    return hmac.compare_digest(proof, stream_proof(key, purpose, caller, callee))


def message_mac(key: bytes, *parts: bytes) -> bytes:
    """MAC of a DHT request or response (its serialized bytes plus nonce and time), 32 bytes."""
    h = hmac.new(key, b"gasloc-dht-auth-v1", hashlib.sha256)
    for p in parts:
        h.update(len(p).to_bytes(8, "big"))   # length-prefixed: no two part lists give the same stream
        h.update(p)
    return h.digest()
