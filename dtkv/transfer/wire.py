"""The byte format of every value the transfer path puts in the rendezvous store: fixed, versioned, no code.

Nothing read from the store is ever unpickled or evaluated. A value is::

    header (12 bytes) | body | tag (32 bytes, only when signed)

- header, little-endian: magic ``b"DTKV"``, version ``u8`` (:data:`VERSION`), kind ``u8`` (:class:`Kind`),
  flags ``u16`` (bit 0: signed), body length ``u32``; a value of another version is refused, never guessed at
  (version 2: a claim carries prefill's nonce, and decode's answer to it is a kind of its own; version 3: an
  endpoint says each buffer's layout, layer-major or page-major; version 4: a rank's open attempts name its
  incarnation, and an attempt's parties finish it with bits, not a count);
- body: the fields of the kind, in the order of its schema (:data:`SCHEMAS`), each one of

  ====  ===================================================================
  code  encoding
  ====  ===================================================================
  ``i`` int64
  ``a`` int64 count ``n``, then ``n`` int64 (an int64 array)
  ``s`` int64 length ``n``, then ``n`` bytes of UTF-8 (a string)
  ``S`` int64 count ``n``, then ``n`` strings (a list of strings)
  ``b`` int64 length ``n``, then ``n`` raw bytes (an opaque blob: a NIXL agent's metadata)
  ====  ===================================================================

- tag: ``HMAC-SHA256(secret, key | 0x00 | header | body)`` when a shared secret is configured
  (``DTKV_TRANSFER_SECRET``). The key is part of the signed bytes, so a value cannot be replayed under another
  key (another request, attempt or rank). A tag proves who wrote a value and for which key, not when: a value
  written back later under its own key verifies again. Freshness is the protocol's (prefill sends only after every
  decode rank answered its fresh nonce, :mod:`dtkv.transfer.protocol`).

:func:`unpack` checks everything before returning: magic, version, kind, flags, lengths, counts (bounded by
the bytes present and by :data:`MAX_ITEMS`), UTF-8, no trailing bytes, and the tag (a signed value without a
secret, or an unsigned value with one, is refused). Each message type then checks its values' ranges
(:mod:`dtkv.transfer.messages`).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence
from enum import IntEnum

import numpy as np

__all__ = ["MAGIC", "MAX_ITEMS", "SCHEMAS", "VERSION", "Kind", "WireError", "pack", "unpack"]

MAGIC = b"DTKV"
VERSION = 4
MAX_ITEMS = 1 << 24
"""Largest array, string or list a value may hold (the reader refuses more before allocating)."""

_HEADER = struct.Struct("<4sBBHI")
_INT = struct.Struct("<q")
_TAG_BYTES = 32
_SIGNED = 1


class Kind(IntEnum):
    """What a value is; the reader states which kinds it accepts for a key."""

    ENDPOINT = 1
    REQUEST = 2
    SLOT_OPEN = 3
    READY = 4
    CLAIM = 5
    ABORTED = 6
    START = 7
    OUTCOME = 8
    OPEN_LIST = 9
    ANSWER = 10
    AGENT = 11


SCHEMAS: dict[Kind, str] = {
    Kind.ENDPOINT: "sisiiisiSaaaaSiiiiia",
    Kind.REQUEST: "ssaiiiii",
    Kind.SLOT_OPEN: "s",
    Kind.READY: "siii",
    Kind.CLAIM: "siiiis",
    Kind.ABORTED: "ss",
    Kind.START: "iaaaSaaa",
    Kind.OUTCOME: "iisiiiii",
    Kind.OPEN_LIST: "SSSaa",
    Kind.ANSWER: "siisii",
    Kind.AGENT: "sibaaa",
}
"""Field codes of each kind (field meanings in :mod:`dtkv.transfer.messages`)."""


class WireError(ValueError):
    """A value that is not a well-formed, authentic dtkv value (the message says what is wrong)."""


def _tag(secret: bytes, key: str, signed_part: bytes) -> bytes:
    return hmac.new(secret, key.encode() + b"\0" + signed_part, hashlib.sha256).digest()


def pack(kind: Kind, fields: Sequence[object], *, key: str, secret: bytes | None) -> bytes:
    """Encode ``fields`` (ints, int arrays, strings, lists of strings, bytes per the kind's schema) for ``key``."""
    schema = SCHEMAS[kind]
    if len(fields) != len(schema):
        raise ValueError(f"fields must hold {len(schema)} values for kind {kind.name}, got {len(fields)}")
    parts: list[bytes] = []
    for code, value in zip(schema, fields):
        if code == "i":
            parts.append(_INT.pack(int(value)))
        elif code == "a":
            arr = np.ascontiguousarray(np.asarray(value, dtype="<i8").ravel())
            parts += [_INT.pack(arr.shape[0]), arr.tobytes()]
        elif code == "s":
            raw = str(value).encode()
            parts += [_INT.pack(len(raw)), raw]
        elif code == "b":
            raw = bytes(value)
            parts += [_INT.pack(len(raw)), raw]
        else:  # "S"
            items = [str(v).encode() for v in value]
            parts.append(_INT.pack(len(items)))
            for raw in items:
                parts += [_INT.pack(len(raw)), raw]
    body = b"".join(parts)
    header = _HEADER.pack(MAGIC, VERSION, int(kind), _SIGNED if secret else 0, len(body))
    return header + body + (_tag(secret, key, header + body) if secret else b"")


def unpack(data: bytes, *, key: str, kinds: Kind | tuple[Kind, ...], secret: bytes | None) -> tuple[Kind, list]:
    """Decode and authenticate a value read from ``key``; returns ``(kind, fields)``.

    Raises:
        WireError: anything malformed, of a kind not in ``kinds``, unsigned while a secret is configured, signed
            while none is, or with a tag that does not verify.
    """
    accepted = (kinds,) if isinstance(kinds, Kind) else kinds
    data = bytes(data)
    if len(data) < _HEADER.size:
        raise WireError(f"value must hold at least a {_HEADER.size}-byte header, got {len(data)} bytes")
    magic, version, kind, flags, body_len = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise WireError(f"value must start with {MAGIC!r}, got {magic!r} (not a dtkv value)")
    if version != VERSION:
        raise WireError(f"value must be of wire version {VERSION}, got version {version}")
    if kind not in {int(k) for k in accepted}:
        got = Kind(kind).name if kind in {int(k) for k in Kind} else f"unknown ({kind})"
        raise WireError(f"value must be of kind {[k.name for k in accepted]}, got kind {got}")
    if flags & ~_SIGNED:
        raise WireError(f"value flags must be 0 or 1, got {flags}")
    tag_len = _TAG_BYTES if flags & _SIGNED else 0
    if len(data) != _HEADER.size + body_len + tag_len:
        raise WireError(f"value must be {_HEADER.size + body_len + tag_len} bytes by its header, got {len(data)}")
    end = _HEADER.size + body_len
    if secret:
        if not tag_len:
            raise WireError("value must be signed (DTKV_TRANSFER_SECRET is set), got an unsigned value")
        if not hmac.compare_digest(data[end:], _tag(secret, key, data[:end])):
            raise WireError(
                "value's HMAC does not verify (forged, corrupted, moved from another key or signed with another key)"
            )
    elif tag_len:
        raise WireError("value is signed but no DTKV_TRANSFER_SECRET is set here (the two sides must share it)")
    kind = Kind(kind)
    reader = _Reader(data, _HEADER.size, end)
    fields = [reader.read(code) for code in SCHEMAS[kind]]
    if reader.pos != end:
        raise WireError(f"value has {end - reader.pos} trailing bytes after its {kind.name} fields")
    return kind, fields


class _Reader:
    def __init__(self, data: bytes, pos: int, end: int) -> None:
        self.data, self.pos, self.end = data, pos, end

    def _int(self) -> int:
        if self.pos + 8 > self.end:
            raise WireError("value is truncated inside an int64 field")
        (v,) = _INT.unpack_from(self.data, self.pos)
        self.pos += 8
        return v

    def _count(self, width: int) -> int:
        n = self._int()
        if not 0 <= n <= MAX_ITEMS or self.pos + n * width > self.end:
            raise WireError(f"value holds a count of {n}, which must be in [0, {MAX_ITEMS}] and fit the value")
        return n

    def _str(self) -> str:
        n = self._count(1)
        raw = self.data[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode()
        except UnicodeDecodeError as e:
            raise WireError(f"value holds a string that is not UTF-8: {e}") from None

    def read(self, code: str) -> object:
        if code == "i":
            return self._int()
        if code == "a":
            n = self._count(8)
            arr = np.frombuffer(self.data, dtype="<i8", count=n, offset=self.pos).astype(np.int64)
            self.pos += 8 * n
            return arr
        if code == "s":
            return self._str()
        if code == "b":
            n = self._count(1)
            raw = bytes(self.data[self.pos : self.pos + n])
            self.pos += n
            return raw
        n = self._count(8)
        return [self._str() for _ in range(n)]
