"""Signed hints (peer/swarm/signed_hints.py): an exchange reply hands over the signed records of the peers it hints
at; the initiator checks one (Admission) instead of looking the peer up in the DHT, and every forged, foreign,
expired, misplaced or oversize record, or too many of them, is refused and never used. The records a peer passes
on come from its own bucket reads, with the signatures its DHT node checked (`_signed_get`)."""
from __future__ import annotations

import asyncio
import base64
from types import SimpleNamespace

import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import ValueWithExpiration, get_dht_time
from test_admission import RUN, FakeDHT, _admission, _announced, _identity, _network, _signer

from gasloc.peer.swarm.membership import Membership, _signed_get, make_validators
from gasloc.peer.swarm.signed_hints import SignedRecords
from gasloc.protocol.buckets import PeerHint
from gasloc.protocol.codes import Code
from gasloc.protocol.messages import MAX_WIRE_MEMBERS, PROTOCOL_VERSION, WIDEST_MEMBER, ExchangeReply
from gasloc.protocol.wire import WireError, decode_header, encode_header


@pytest.fixture(scope="module")
def signers():
    return [_signer() for _ in range(4)]


def test_an_honest_handed_record_is_checked_once_then_kept_and_passed_on(signers):
    hinted = _announced(FakeDHT(), signers[0])
    book, adm = SignedRecords(), _admission(signers)
    assert book.offered("hinter", [hinted.inline]) == 1 and book.has_offer(hinted.peer_id)
    assert book.attach([hinted.peer_id], get_dht_time()) == ()          # unchecked: never passed on
    rec, why = book.check(hinted.peer_id, adm, get_dht_time())
    assert why == "" and rec.peer_id == hinted.peer_id and rec.state == "exchanging"
    assert book.accepted == 1 and not book.has_offer(hinted.peer_id)    # each offer is checked once
    assert book.attach(["nobody", hinted.peer_id], get_dht_time()) == (hinted.inline,)
    assert book.attach([hinted.peer_id], hinted.inline.expiration + 1) == ()   # expired: not passed on


def test_forged_foreign_expired_and_misplaced_handed_records_are_refused_and_never_used(signers, caplog):
    hinted, other = _announced(FakeDHT(), signers[0]), _announced(FakeDHT(), signers[1])
    foreign_run = _announced(FakeDHT(), signers[2], run="otherrun")
    other_fp = _announced(FakeDHT(), signers[3], fingerprint="g")
    w = hinted.inline
    flipped = base64.b64decode(w.value).replace(b"exchanging", b"training\0\0")
    cases = {
        "signature or schema invalid": w.model_copy(update={"value": base64.b64encode(flipped).decode()}),
        "record expired": w.model_copy(update={"expiration": get_dht_time() - 1}),
        "record is not under a bucket key of this run": w.model_copy(update={"key": w.key.replace(RUN, "x")}),
    }
    adm = _admission(signers)
    for why, member in cases.items():
        book = SignedRecords()
        book.offered("liar", [member])
        with caplog.at_level("INFO", logger="gasloc.peer.swarm.signed_hints"):
            rec, got = book.check(hinted.peer_id, adm, get_dht_time())
        assert rec is None and got == why and book.refused == 1, (why, got)
        assert book.attach([hinted.peer_id], get_dht_time()) == ()      # never passed on
        assert f"signed_hint_refused peer={hinted.peer_id} from=liar why={why}" in caplog.text
    book = SignedRecords()
    # a genuine record of another run or configuration admits nobody to ours
    book.offered("liar", [foreign_run.inline, other_fp.inline])
    assert book.check(foreign_run.peer_id, adm, get_dht_time())[1] == "record is not under a bucket key of this run"
    assert book.check(other_fp.peer_id, adm, get_dht_time())[1] == "record of another configuration or protocol"
    # a record is filed under the peer its key derives to, never under a name the sender gives it: another
    # peer's genuine record handed with a hint of `hinted` is no record of `hinted`
    book.offered("liar", [other.inline])
    assert not book.has_offer(hinted.peer_id) and book.has_offer(other.peer_id)
    # a subkey that holds no owner key belongs to nobody
    assert book.offered("liar", [w.model_copy(update={"subkey": "[owner:nothing]"})]) == 0
    assert book.offered("liar", [w.model_copy(update={"subkey": "[ed25519:nothing=]"})]) == 0


def test_too_many_or_oversize_handed_records_make_the_reply_invalid():
    def reply(members):
        return ExchangeReply.model_construct(protocol_version=PROTOCOL_VERSION, code=int(Code.BUSY), message="",
                                             fingerprint="f", round=0, codec="float32", specs=(), total_bytes=0,
                                             token="", auth="", peers=(), members=members, kind="exchange_reply")
    assert decode_header(encode_header(reply((WIDEST_MEMBER,) * MAX_WIRE_MEMBERS))[4:], ExchangeReply).members
    for members in ((WIDEST_MEMBER,) * (MAX_WIRE_MEMBERS + 1),
                    (WIDEST_MEMBER.model_copy(update={"value": "v" * 5000}),)):
        with pytest.raises(WireError) as e:
            decode_header(encode_header(reply(members))[4:], ExchangeReply)
        assert e.value.code == Code.BAD_HEADER
    # and a sender that gets past the model anyway is cut at MAX_WIRE_MEMBERS
    book = SignedRecords()
    assert book.offered("x", [WIDEST_MEMBER] * 9) == 0 and book.refused == MAX_WIRE_MEMBERS


def test_a_bucket_read_keeps_the_signatures_its_dht_node_checked(signers):
    """_signed_get, as the DHT process runs it: the node's get result plus each record's signed bytes, kept by
    CachedSignatureValidator when hivemind stripped them; what it returns is a record anyone can check."""
    member = _announced(FakeDHT(), signers[0])
    w = member.inline
    signer, validators = make_validators(RUN, _identity(signers[1]))
    composite = CompositeValidator(validators)
    subkey = w.subkey.encode()
    record = DHTRecord(DHTID.generate(source=w.key).to_bytes(), MSGPackSerializer.dumps(subkey),
                       base64.b64decode(w.value), w.expiration)
    assert composite.validate(record)
    value = MSGPackSerializer.loads(composite.strip_value(record))      # what a get hands back, stripped

    class Node:
        protocol = SimpleNamespace(record_validator=composite)

        async def get(self, key, latest, beam_size):
            return ValueWithExpiration({subkey: ValueWithExpiration(value, w.expiration)}, w.expiration)

    found, raw = asyncio.run(_signed_get(w.key, 5, None, Node()))
    assert raw == {subkey: base64.b64decode(w.value)}
    # BucketReader keeps it as a WireMember that passes another peer's check
    kept = SignedRecords()
    reader = Membership(FakeDHT(), signer, run_id=RUN, peer_id="me", fingerprint="f", protocol=PROTOCOL_VERSION,
                        ttl_s=15.0)
    reader.signed_sink = kept.keep
    reader._keep_signed(w.key, found, raw)
    (passed,) = kept.attach([member.peer_id], get_dht_time())
    rec, why = _admission(signers).check(member.peer_id, passed, get_dht_time())
    assert why == "" and rec.peer_id == member.peer_id
    # bytes that are not this value plus a signature are not returned as its signed form
    signer.__dict__["_signed"][(record.key, record.subkey, record.expiration_time)] = b"\x81junk"
    assert asyncio.run(_signed_get(w.key, 5, None, Node()))[1] == {}


def test_the_network_calls_a_hinted_peer_on_its_handed_record_without_a_dht_lookup(signers):
    dht = FakeDHT()
    hinted = _announced(FakeDHT(), signers[1])
    net = _network(dht, signers)
    pid = PeerID.from_base58(hinted.peer_id)

    async def main():
        net.heard("hinter", [PeerHint(hinted.peer_id, "exchanging", 4)])
        forged = hinted.inline.model_copy(update={"expiration": hinted.inline.expiration + 5})
        net.members_heard("hinter", [forged])
        assert not await net.confirm_member(pid)        # refused, then looked up (and not found in this DHT)
        assert dht.gets and net.signed.refused == 1
        dht.gets.clear()
        net.members_heard("hinter", [hinted.inline])
        assert await net.confirm_member(pid)            # the handed record admits it: no get
        assert dht.gets == [] and hinted.peer_id in net.live
        # and we pass it on to whoever we hint it to
        assert net.members_for("someone", [PeerHint(hinted.peer_id, "exchanging", 4)]) == (hinted.inline,)
        assert net.members_for(hinted.peer_id, [PeerHint(hinted.peer_id, "exchanging", 4)]) == ()
        m = net.membership_metrics()                    # the round's metrics count both, once
        assert (m["signed_hints_used"], m["signed_hints_refused"]) == (1, 1)
        assert net.membership_metrics()["signed_hints_refused"] == 0
    asyncio.run(main())
