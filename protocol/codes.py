"""Status codes of the exchange and state-transfer protocols.

A code travels in a reply header (before any tensor bytes) or as the one-byte verdict at the end of an exchange,
so every value fits in one byte. Each member carries its "voice": what the peer that sends it is saying.
Values are part of the wire format: never renumber, only append.
"""
from __future__ import annotations

from enum import IntEnum


class Code(IntEnum):
    """A wire status code; `Code.X.voice` is its one-line meaning."""

    voice: str

    def __new__(cls, value: int, voice: str) -> Code:
        member = int.__new__(cls, value)
        member._value_ = value
        member.voice = voice
        return member

    OK = 0, "I accept: here come my tensors (or: all of yours arrived and passed every check)."
    BUSY = 1, "I am exchanging with someone else or not ready yet; try another peer."
    BAD_VERSION = 2, "I speak a different protocol version; we cannot talk."
    BAD_FINGERPRINT = 3, "You train a different model or configuration (your fingerprint is not mine)."
    BAD_SHAPE = 4, "Your tensor count or shapes differ from my model's."
    BAD_DTYPE = 5, "Your tensor dtypes or wire dtype are not ones I expect."
    TOO_LARGE = 6, "You declared more bytes than I will receive; I do not buffer them."
    NOT_FINITE = 7, "Your tensors contain NaN or Inf; I discarded them."
    NOT_MEMBER = 8, "You are not a live member of my run; I do not exchange with strangers."
    BAD_HEADER = 9, "I cannot parse your header, or it contradicts itself (a byte count that does not fit shapes)."
    TIMEOUT = 10, "You were too slow: my deadline passed before we finished."
    INTERNAL = 11, "Something failed on my side; not your fault, try later or elsewhere."
    BAD_CHECKSUM = 12, "Your payload does not match the checksum your header declared."
    DISTRUSTED = 13, "Your model is too far from mine, or worse on my data: I did not mix it in (protocol/guard.py)."
    NOT_AUTHORIZED = 14, "You did not prove this private swarm's key; I do not talk to outsiders."
    RATE_LIMITED = 15, "You asked me for this too recently; ask another peer, or me again later."
    NOT_ATTACHED = 16, "The peer you want me to forward to is not attached to me: I have no way to reach it."
    FORWARD_FULL = 17, "I already forward as many circuits (or hold as many attached peers) as I volunteer for."
    NOT_FORWARDING = 18, "I do not forward for others (I am not publicly reachable, or I did not volunteer)."

    @classmethod
    def parse(cls, value: int) -> Code:
        """The code for a received byte; an unknown value (a newer peer's code) reads as BAD_HEADER."""
        try:
            return cls(value)
        except ValueError:
            return cls.BAD_HEADER
