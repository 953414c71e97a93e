"""Host-side exchanges of the materialization path over the CPU channel (:func:`dtkv._collectives.cpu_channel`), so
that none of them waits for the GPU. The plan check (:func:`dtkv._agree.agree`) runs on it; :func:`exchange_votes`
all-gathers one fixed-size :data:`PAYLOAD_BYTES`-byte record per rank (the copy-engine topology probe); received
bytes are parsed field by field (fixed offsets, bounded lengths, UTF-8 with replacement), never unpickled.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dtkv._collectives import all_gather_into, cpu_channel

__all__ = ["PAYLOAD_BYTES", "Vote", "exchange_votes"]

PAYLOAD_BYTES = 256
_DIGEST = 16
_HEAD = struct.Struct("<16sBBH")  # digest, ok, summary length, message length
_SUMMARY_MAX = 64
_MESSAGE_MAX = PAYLOAD_BYTES - _HEAD.size - _SUMMARY_MAX


@dataclass(frozen=True, kw_only=True, slots=True)
class Vote:
    """One rank's record."""

    digest: bytes
    """16 bytes naming what the rank is about to do (equal on every rank when they agree)."""
    ok: bool
    """False when the rank's own validation failed."""
    summary: str = ""
    """A few words describing the rank's input (shown when digests differ)."""
    message: str = ""
    """The rank's error message when ``ok`` is False."""

    def encode(self) -> bytes:
        summary = self.summary.encode()[:_SUMMARY_MAX]
        message = self.message.encode()[:_MESSAGE_MAX]
        digest = self.digest[:_DIGEST].ljust(_DIGEST, b"\0")
        raw = _HEAD.pack(digest, int(self.ok), len(summary), len(message)) + summary.ljust(_SUMMARY_MAX, b"\0")
        return (raw + message).ljust(PAYLOAD_BYTES, b"\0")

    @classmethod
    def decode(cls, raw: bytes) -> Vote:
        digest, ok, n_summary, n_message = _HEAD.unpack_from(raw)
        n_summary, n_message = min(n_summary, _SUMMARY_MAX), min(n_message, _MESSAGE_MAX)
        summary = raw[_HEAD.size : _HEAD.size + n_summary].decode(errors="replace")
        start = _HEAD.size + _SUMMARY_MAX
        message = raw[start : start + n_message].decode(errors="replace")
        return cls(digest=digest, ok=bool(ok), summary=summary, message=message)


def exchange_votes(vote: Vote, group: dist.ProcessGroup | None) -> list[Vote]:
    """All-gather every rank's :class:`Vote` (collective over ``group``; ``[vote]`` without a group).

    Cost: one ``world * PAYLOAD_BYTES``-byte all-gather on the CPU channel (tens of microseconds on one host).
    """
    if group is None or dist.get_world_size(group) == 1:
        return [vote]
    channel = cpu_channel(group)
    world = dist.get_world_size(group)
    mine = torch.frombuffer(bytearray(vote.encode()), dtype=torch.uint8)
    out = torch.empty(world * PAYLOAD_BYTES, dtype=torch.uint8)
    all_gather_into(out, mine, channel)
    rows = out.view(world, PAYLOAD_BYTES)
    return [Vote.decode(rows[r].numpy().tobytes()) for r in range(world)]
