"""libp2p identity files of gasloc peers: Ed25519 keys (what gasloc makes now) beside the RSA ones hivemind makes.

The file is what p2pd runs with (`-id`): a protobuf PrivateKey. For Ed25519 its data is the 32-byte seed followed
by the 32-byte public key, as go-libp2p marshals it (its older 96-byte form repeats the public key). p2pd accepts
such a file and reports the peer id derived here (checked with hivemind 1.1.12's p2pd): libp2p's rule for keys of at
most 42 bytes is the *identity* multihash of the protobuf PublicKey (peer ids `12D3KooW...`), not its sha2-256 as
for RSA. Why Ed25519: docs/membership.md (a record signed with it is less than half the bytes).
"""
from __future__ import annotations

import os
from pathlib import Path

import base58
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.proto import crypto_pb2

_IDENTITY_MULTIHASH = 0x00   # multihash code "identity": the digest is the bytes themselves


class Ed25519Identity:
    """A peer's Ed25519 private key (the libp2p identity it runs with)."""

    def __init__(self, key: Ed25519PrivateKey | None = None):
        self.key = key or Ed25519PrivateKey.generate()
        self.public = self.key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    def sign(self, data: bytes) -> bytes:
        return self.key.sign(data)

    def to_libp2p(self) -> bytes:
        """The identity file's bytes: protobuf PrivateKey(Ed25519, seed + public key)."""
        seed = self.key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                      serialization.NoEncryption())
        return crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Ed25519, data=seed + self.public).SerializeToString()

    @classmethod
    def from_libp2p_data(cls, data: bytes) -> Ed25519Identity:
        """From a protobuf PrivateKey's data: seed + public key (64 bytes; go-libp2p's older 96-byte form repeats
        the public key). ValueError when the public key does not belong to the seed."""
        if len(data) not in (64, 96):
            raise ValueError(f"an Ed25519 private key is 64 bytes, not {len(data)}")
        ident = cls(Ed25519PrivateKey.from_private_bytes(data[:32]))
        if data[32:64] != ident.public or (len(data) == 96 and data[64:] != ident.public):
            raise ValueError("the public key in the file does not belong to its private key")
        return ident


def write_identity_file(path: str | Path) -> Ed25519Identity:
    """A new Ed25519 identity in `path` (created, mode 0400, as hivemind's P2P.generate_identity writes an RSA one);
    OSError as the file system raises it."""
    ident = Ed25519Identity()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
    with os.fdopen(fd, "wb") as f:
        f.write(ident.to_libp2p())
    return ident


def peer_id_of_public(public: bytes) -> str:
    """The libp2p peer id (base58) of a 32-byte Ed25519 public key: identity multihash of the protobuf PublicKey."""
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.KeyType.Ed25519, data=public).SerializeToString()
    return base58.b58encode(bytes([_IDENTITY_MULTIHASH, len(encoded)]) + encoded).decode()
