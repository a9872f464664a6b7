"""Ed25519 identities (runtime/identity.py) and the records signed with them (peer/swarm/ed25519.py): the peer id a
key derives to (golden; p2pd's own answer is checked in tests/integration/test_safe_dht_start.py), identity files,
the signature check beside the RSA one, and the bytes a record costs in a bucket."""
from __future__ import annotations

import base64
import stat
import time

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import ValueWithExpiration

from gasloc.peer.swarm import ed25519
from gasloc.peer.swarm.membership import (
    IdentityError,
    Membership,
    bucket_key,
    entry_bytes,
    load_identity,
    make_validators,
    peer_id_of,
)
from gasloc.runtime.identity import Ed25519Identity, peer_id_of_public, write_identity_file

RUN = "edrun"
SEED = bytes(range(1, 33))
# the peer id of SEED's key: libp2p's identity multihash of the protobuf PublicKey, base58. p2pd reports the same
# for an identity file of this key (p2pd of hivemind 1.1.12, 2026-12-04; and on every run, the integration test)
GOLDEN_PEER_ID = "12D3KooWJ1TsijH7H5F74hfAD5XishQz3sxrmAtVY37GtNd9CqYf"


def _seeded() -> Ed25519Identity:
    return Ed25519Identity(Ed25519PrivateKey.from_private_bytes(SEED))


def _signed(validator, signer, value, *, subkey=None) -> DHTRecord:
    """A record as DHTNode.store builds it: key id, msgpack subkey and value, signed by the node's validators."""
    rec = DHTRecord(DHTID.generate(source=bucket_key(RUN, 2, 1)).to_bytes(),
                    MSGPackSerializer.dumps(subkey if subkey is not None else signer.local_public_key),
                    MSGPackSerializer.dumps(value), time.time() + 30)
    return DHTRecord(rec.key, rec.subkey, validator.sign_value(rec), rec.expiration_time)


def _record(signer) -> dict:
    m = Membership(None, signer, run_id=RUN, peer_id=peer_id_of(signer.local_public_key), fingerprint="f",
                   protocol=2, ttl_s=30.0)
    return m.record(state="exchanging", round=10, throughput_tps=1000.0, bandwidth_bps=1e7, loss=3.2,
                    val_loss=3.3, round_s=12.0, partners=[]).dict()


def test_the_peer_id_of_a_key_is_libp2ps_identity_multihash():
    ident = _seeded()
    assert peer_id_of_public(ident.public) == GOLDEN_PEER_ID
    signer, _ = make_validators(RUN, ident)
    assert signer.local_public_key == b"[ed25519:" + base64.b64encode(ident.public) + b"]"
    assert peer_id_of(signer.local_public_key) == GOLDEN_PEER_ID
    # one owner key per subkey, whichever kind: two make it nobody's
    rsa_signer, _ = make_validators(RUN, RSAPrivateKey())
    assert peer_id_of(signer.local_public_key + rsa_signer.local_public_key) is None
    assert peer_id_of(signer.local_public_key + make_validators(RUN)[0].local_public_key) is None
    assert peer_id_of(b"[ed25519:short=]") is None
    # the key's last base64 character carries two unused bits: the other three texts of the same key are no owner
    # (else one peer could hold four subkeys), and a record under one fails every node's check
    text = signer.local_public_key[9:52]
    alphabet = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    twin = b"[ed25519:" + text[:-1] + alphabet[alphabet.index(text[-1:]) ^ 1:][:1] + b"=]"
    assert base64.b64decode(twin[9:53]) == ident.public and twin != signer.local_public_key
    assert peer_id_of(twin) is None
    rec = DHTRecord(DHTID.generate(source=bucket_key(RUN, 2, 1)).to_bytes(), MSGPackSerializer.dumps(twin),
                    MSGPackSerializer.dumps({"x": 1}), time.time() + 30)
    signature = base64.b64encode(ident.sign(MSGPackSerializer.dumps(
        (rec.key, rec.subkey, rec.value, rec.expiration_time))))
    assert not ed25519.Ed25519SignatureValidator(Ed25519Identity()).validate(
        DHTRecord(rec.key, rec.subkey, rec.value + b"[ed25519sig:" + signature + b"]", rec.expiration_time))
    good = DHTRecord(rec.key, MSGPackSerializer.dumps(signer.local_public_key), rec.value, rec.expiration_time)
    assert ed25519.Ed25519SignatureValidator(Ed25519Identity()).validate(
        DHTRecord(good.key, good.subkey, signer.sign_value(good), good.expiration_time))


def test_identity_files_round_trip_and_bad_ones_are_one_line(tmp_path):
    path = tmp_path / "id.key"
    made = write_identity_file(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o400
    loaded = load_identity(path)
    assert isinstance(loaded, Ed25519Identity) and loaded.public == made.public
    with pytest.raises(FileExistsError):       # never over an existing identity
        write_identity_file(path)
    # go-libp2p's older 96-byte form (the public key repeated) is the same key
    seeded = _seeded()
    old = tmp_path / "old.key"
    old.write_bytes(crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Ed25519,
                                          data=SEED + seeded.public * 2).SerializeToString())
    assert load_identity(old).public == seeded.public
    bad = tmp_path / "bad.key"
    bad.write_bytes(crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Ed25519,
                                          data=SEED + made.public).SerializeToString())   # another key's public half
    with pytest.raises(IdentityError, match="malformed Ed25519 key: the public key .* does not belong"):
        load_identity(bad)
    bad.unlink()
    bad.write_bytes(crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Ed25519, data=SEED).SerializeToString())
    with pytest.raises(IdentityError, match="malformed Ed25519 key: an Ed25519 private key is 64 bytes, not 32"):
        load_identity(bad)
    bad.unlink()
    bad.write_bytes(crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Secp256k1, data=SEED).SerializeToString())
    with pytest.raises(IdentityError, match="holds a Secp256k1 key; gasloc peers need an Ed25519 or RSA identity"):
        load_identity(bad)


@pytest.fixture(scope="module")
def nodes():
    """Three DHT nodes' validators: two with Ed25519 identities, one with an RSA identity file's key."""
    return [(s, CompositeValidator(v)) for s, v in (make_validators(RUN), make_validators(RUN),
                                                      make_validators(RUN, RSAPrivateKey()))]


def test_records_of_either_kind_pass_every_node_and_nobody_signs_for_another(nodes):
    (ed_a, val_a), (ed_b, val_b), (rsa_c, val_c) = nodes
    for signer, val in nodes:
        rec = _signed(val, signer, _record(signer))
        assert all(v.validate(rec) for _, v in nodes)
        assert MSGPackSerializer.loads(val_b.strip_value(rec)) == _record(signer) | {"time": _record_time(rec, val_b)}
    # B (Ed25519) and C (RSA) write under A's key: their nodes do not sign it, and no node accepts it
    for forger, val in ((ed_b, val_b), (rsa_c, val_c)):
        forged = _signed(val, forger, _record(ed_a), subkey=ed_a.local_public_key)
        assert not any(v.validate(forged) for _, v in nodes)
    # A's record with B's signature spliced in: refused
    good_b = _signed(val_b, ed_b, _record(ed_b))
    sig_b = ed25519.SIGNATURE_RE.search(good_b.value).group(0)
    good_a = _signed(val_a, ed_a, _record(ed_a))
    spliced = DHTRecord(good_a.key, good_a.subkey, ed25519.SIGNATURE_RE.sub(b"", good_a.value) + sig_b,
                        good_a.expiration_time)
    assert not val_c.validate(spliced)
    # a changed value, a changed expiration, two signatures, none: refused
    value = MSGPackSerializer.dumps(_record(ed_a) | {"round": 11})
    assert not val_c.validate(DHTRecord(good_a.key, good_a.subkey,
                                        value + ed25519.SIGNATURE_RE.search(good_a.value).group(0),
                                        good_a.expiration_time))
    assert not val_c.validate(DHTRecord(good_a.key, good_a.subkey, good_a.value, good_a.expiration_time + 1))
    assert not val_c.validate(DHTRecord(good_a.key, good_a.subkey, good_a.value + sig_b, good_a.expiration_time))
    assert not val_c.validate(DHTRecord(good_a.key, good_a.subkey, ed25519.SIGNATURE_RE.sub(b"", good_a.value),
                                        good_a.expiration_time))


def _record_time(rec: DHTRecord, val) -> float:
    return MSGPackSerializer.loads(val.strip_value(rec))["time"]


def test_an_ed25519_entry_is_less_than_half_an_rsa_one(nodes):
    """What the change is for: the bytes a record costs in a bucket, as the listing counts them (entry_bytes)."""
    sizes = {}
    for name, (signer, val) in zip(("ed", "ed2", "rsa"), nodes):
        rec = _signed(val, signer, _record(signer))
        subkey = MSGPackSerializer.loads(rec.subkey)
        value = MSGPackSerializer.loads(val.strip_value(rec))
        sizes[name] = entry_bytes(ValueWithExpiration({subkey: ValueWithExpiration(value, 0.0)}, 0.0))
        # the estimate counts the signature the DHT stripped: it is the bytes the bucket holds
        assert sizes[name] == len(rec.subkey) + len(rec.value) + 8
    assert sizes["ed"] < 0.5 * sizes["rsa"] and sizes["ed"] < 520 and sizes["rsa"] > 1000, sizes
