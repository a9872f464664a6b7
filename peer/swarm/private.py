"""A private swarm's DHT: every DHT RPC carries a MAC made with the swarm key (hivemind's authorizer hook).

hivemind wraps each DHT RPC (ping, store, find) in an AuthorizerBase: the caller signs the request, the servicer
validates it and answers nothing when it fails, and the caller validates the response the same way. Here the
"signature" is message_mac(key, request bytes, time, nonce): a node without the key cannot store a record, read
one, or even join the routing table of a keyed node, and a keyed node ignores what a keyless node answers. A
request is accepted once (its nonce is remembered) and only within MAX_CLOCK_SKEW_S of our clock, so a recorded
request cannot be replayed later. Our own streams (exchange, state) are gated separately (protocol/auth.py).
"""
from __future__ import annotations

import logging
import secrets
import struct
from collections import OrderedDict

from hivemind.utils.auth import AuthorizedRequestBase, AuthorizedResponseBase, AuthorizerBase
from hivemind.utils.timed_storage import get_dht_time

from gasloc.protocol.auth import message_mac

log = logging.getLogger(__name__)

MAX_CLOCK_SKEW_S = 300.0      # hivemind itself tolerates this much DHT time discrepancy between nodes
MAX_REMEMBERED_NONCES = 100_000
NONCE_BYTES = 16
_TIME = struct.Struct(">d")


class SwarmKeyAuthorizer(AuthorizerBase):
    """MACs on DHT requests and responses with a shared key. Runs inside the DHT's process and event loop."""

    def __init__(self, key: bytes):
        self._key = key
        self._seen: OrderedDict[bytes, float] = OrderedDict()   # nonce -> its request time, oldest first
        self.rejected = 0

    def _mac(self, message, nonce: bytes, t: float) -> bytes:
        return message_mac(self._key, message.SerializeToString(), nonce, _TIME.pack(t))

    async def sign_request(self, request: AuthorizedRequestBase, service_public_key) -> None:
        auth = request.auth
        auth.time, auth.nonce, auth.signature = get_dht_time(), secrets.token_bytes(NONCE_BYTES), b""
        auth.signature = self._mac(request, auth.nonce, auth.time)

    async def validate_request(self, request: AuthorizedRequestBase) -> bool:
        auth = request.auth
        signature, auth.signature = auth.signature, b""
        try:
            good = secrets.compare_digest(signature, self._mac(request, auth.nonce, auth.time))
        finally:
            auth.signature = signature
        now = get_dht_time()
        if not good or abs(now - auth.time) > MAX_CLOCK_SKEW_S or len(auth.nonce) != NONCE_BYTES:
            return self._reject("bad MAC or stale request")
        if auth.nonce in self._seen:
            return self._reject("replayed request")
        self._remember(auth.nonce, now)
        return True

    async def sign_response(self, response: AuthorizedResponseBase, request: AuthorizedRequestBase) -> None:
        auth = response.auth
        auth.nonce, auth.signature = request.auth.nonce, b""
        auth.signature = self._mac(response, auth.nonce, request.auth.time)

    async def validate_response(self, response: AuthorizedResponseBase, request: AuthorizedRequestBase) -> bool:
        auth = response.auth
        if auth.nonce != request.auth.nonce:
            return self._reject("response to another request")
        signature, auth.signature = auth.signature, b""
        try:
            good = secrets.compare_digest(signature, self._mac(response, auth.nonce, request.auth.time))
        finally:
            auth.signature = signature
        return True if good else self._reject("bad MAC on a response")

    def _remember(self, nonce: bytes, now: float) -> None:
        self._seen[nonce] = now
        # forget nonces older than the skew window (their requests are refused as stale anyway), and cap the table
        while self._seen and (len(self._seen) > MAX_REMEMBERED_NONCES
                              or next(iter(self._seen.values())) < now - 2 * MAX_CLOCK_SKEW_S):
            self._seen.popitem(last=False)

    def _reject(self, why: str) -> bool:
        self.rejected += 1
        # debug: a keyless node probing us would otherwise flood the log; the count is what matters
        log.debug("dht_auth_rejected why=%s total=%d", why, self.rejected)
        return False
