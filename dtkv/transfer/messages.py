"""The records of the transfer protocol (:mod:`dtkv.transfer.protocol`), with their wire schemas.

Each record has a :class:`dtkv.transfer.wire.Kind`, turns into schema fields with ``to_fields()`` and is
rebuilt, after range checks of every value, with ``from_fields(fields)`` (which raises
:class:`dtkv.transfer.wire.WireError` on anything out of range).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from dtkv.ownership import PageOwnership
from dtkv.transfer.descriptors import BufferSpec, RankEndpoint, StageCopy
from dtkv.transfer.protocol import check_epoch, check_nonce
from dtkv.transfer.wire import Kind, WireError

__all__ = [
    "AGENT_NAME",
    "Aborted",
    "AgentRecord",
    "Answer",
    "Claim",
    "DstRequest",
    "OpenList",
    "Ready",
    "SendOutcome",
    "SendStart",
    "SlotOpen",
    "endpoint_fields",
    "endpoint_from_fields",
]

MAX_RANKS = 1 << 16
MAX_PAGES = 1 << 40
MAX_ADDR = (1 << 63) - 1
MAX_TEXT = 1 << 16
MAX_AGENT_METADATA = 1 << 24
"""Largest NIXL agent metadata blob a record may carry (bytes)."""
MAX_REGIONS = 1 << 16
MAX_REGION_ADDR = 1 << 60
"""Bound on a region's address and length (user-space and CUDA addresses lie far below; sums cannot overflow)."""
AGENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
"""What a transfer agent's name may be (it is part of a store key and of the session ``nixl:{name}``)."""


def _int(name: str, v: int, lo: int, hi: int) -> int:
    if not lo <= v <= hi:
        raise WireError(f"{name} must be in [{lo}, {hi}], got {name}={v}")
    return int(v)


def _arr(name: str, a: np.ndarray, lo: int, hi: int) -> np.ndarray:
    if a.size and (int(a.min()) < lo or int(a.max()) > hi):
        raise WireError(f"{name} must hold values in [{lo}, {hi}], got [{int(a.min())}, {int(a.max())}]")
    return a


def _text(name: str, s: str, *, nonempty: bool = False, limit: int = MAX_TEXT) -> str:
    if len(s) > limit or (nonempty and not s):
        raise WireError(f"{name} must be a{' non-empty' if nonempty else ''} string of at most {limit} characters")
    return s


def _epoch(s: str) -> str:
    if not check_epoch(s):
        raise WireError(f"epoch must be 16 hex digits, got {s[:40]!r}")
    return s


def _nonce(s: str) -> str:
    if not check_nonce(s):
        raise WireError(f"nonce must be 32 hex digits, got {s[:40]!r}")
    return s


def _flag(name: str, v: int) -> bool:
    return bool(_int(name, v, 0, 1))


def _opt(v: int | None) -> int:
    return -1 if v is None else int(v)


# ---------------------------------------------------------------------------------------------------- endpoints
def endpoint_fields(ep: RankEndpoint) -> list:
    bufs = ep.buffers
    return [
        ep.role,
        ep.rank,
        ep.session,
        ep.incarnation,
        ep.ownership.cp_size,
        ep.ownership.num_pages,
        ep.ownership.scheme,
        ep.num_layers,
        [b.name for b in bufs],
        [b.addr for b in bufs],
        [b.num_local_pages for b in bufs],
        [b.page_bytes for b in bufs],
        [b.elem_bytes for b in bufs],
        [b.layout_key for b in bufs],
        ep.staging_addr,
        ep.staging_bytes,
        ep.meta_addr,
        ep.meta_row_bytes,
        ep.meta_num_rows,
        [int(b.page_major) for b in bufs],
    ]


def endpoint_from_fields(f: list) -> RankEndpoint:
    role, rank, session, incarnation, cp_size, num_pages, scheme, num_layers = f[:8]
    names, addr, local, page_bytes, elem_bytes, layout_keys = f[8:14]
    if role not in ("prefill", "decode"):
        raise WireError(f"role must be 'prefill' or 'decode', got {role[:20]!r}")
    if scheme not in ("interleave", "block"):
        raise WireError(f"ownership scheme must be 'interleave' or 'block', got {scheme[:20]!r}")
    cp_size = _int("cp_size", cp_size, 1, MAX_RANKS)
    n = len(names)
    page_major = f[19]
    fields = (addr, local, page_bytes, elem_bytes, layout_keys, page_major)
    if not 1 <= n <= 64 or not all(len(x) == n for x in fields):
        raise WireError(f"buffers must be 1..64 with one value of each field per buffer, got {n} names")
    _arr("buffer addr", addr, 0, MAX_ADDR)
    _arr("num_local_pages", local, 0, MAX_PAGES)
    _arr("page_bytes", page_bytes, 1, 1 << 40)
    _arr("elem_bytes", elem_bytes, 1, 64)
    _arr("page_major", page_major, 0, 1)
    buffers = tuple(
        BufferSpec(
            name=_text("buffer name", names[i], nonempty=True, limit=128),
            addr=int(addr[i]),
            num_local_pages=int(local[i]),
            page_bytes=int(page_bytes[i]),
            elem_bytes=int(elem_bytes[i]),
            layout_key=_text("layout_key", layout_keys[i]),
            page_major=bool(page_major[i]),
        )
        for i in range(n)
    )
    if len({b.name for b in buffers}) != n:
        raise WireError(f"buffer names must be distinct, got {names}")
    try:
        ownership = PageOwnership(cp_size, _int("num_pages", num_pages, 1, MAX_PAGES), scheme)
    except (TypeError, ValueError) as e:
        raise WireError(f"ownership is invalid: {e}") from None
    return RankEndpoint(
        role=role,
        rank=_int("rank", rank, 0, cp_size - 1),
        session=_text("session", session, nonempty=True, limit=512),
        incarnation=incarnation,
        ownership=ownership,
        num_layers=_int("num_layers", num_layers, 1, 1 << 20),
        buffers=buffers,
        staging_addr=_int("staging_addr", f[14], 0, MAX_ADDR),
        staging_bytes=_int("staging_bytes", f[15], 0, MAX_ADDR),
        meta_addr=_int("meta_addr", f[16], 0, MAX_ADDR),
        meta_row_bytes=_int("meta_row_bytes", f[17], 0, 1 << 30),
        meta_num_rows=_int("meta_num_rows", f[18], 0, 1 << 30),
    )


# ---------------------------------------------------------------------------------------------------- attempt
@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class DstRequest:
    """What decode rank 0 posts under ``req/{request_id}``: the current attempt and where each position goes."""

    KIND = Kind.REQUEST
    request_id: str
    epoch: str
    """The attempt (16 hex digits); every other key of the attempt is under ``req/{request_id}/{epoch}``."""
    dst_pages: np.ndarray
    """int64 ``[num_positions]``: decode logical page of each position."""
    num_tokens: int | None = None
    """Tokens of the request (checked against the page count when given)."""
    dst_meta_slot: int | None = None
    """Decode metadata row receiving the replicated row (``None``: no metadata)."""
    num_prefill: int = 1
    num_decode: int = 1
    timeout_ms: int = 0
    """Decode's wait bound for this attempt (informative)."""

    def to_fields(self) -> list:
        return [
            self.request_id,
            self.epoch,
            self.dst_pages,
            _opt(self.num_tokens),
            _opt(self.dst_meta_slot),
            self.num_prefill,
            self.num_decode,
            self.timeout_ms,
        ]

    @classmethod
    def from_fields(cls, f: list) -> DstRequest:
        num_tokens, slot = _int("num_tokens", f[3], -1, MAX_PAGES), _int("dst_meta_slot", f[4], -1, 1 << 30)
        return cls(
            request_id=_text("request_id", f[0], nonempty=True, limit=256),
            epoch=_epoch(f[1]),
            dst_pages=_arr("dst_pages", f[2], 0, MAX_PAGES),
            num_tokens=None if num_tokens < 0 else num_tokens,
            dst_meta_slot=None if slot < 0 else slot,
            num_prefill=_int("num_prefill", f[5], 1, MAX_RANKS),
            num_decode=_int("num_decode", f[6], 1, MAX_RANKS),
            timeout_ms=_int("timeout_ms", f[7], 0, 1 << 40),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class SlotOpen:
    """A slot nobody claimed yet."""

    KIND = Kind.SLOT_OPEN
    epoch: str

    def to_fields(self) -> list:
        return [self.epoch]

    @classmethod
    def from_fields(cls, f: list) -> SlotOpen:
        return cls(epoch=_epoch(f[0]))


@dataclass(frozen=True, kw_only=True, slots=True)
class Ready:
    """A decode rank's claimed slot: it takes part, with or without its staging region."""

    KIND = Kind.READY
    epoch: str
    rank: int
    incarnation: int
    """The decode rank's endpoint incarnation (prefill re-reads endpoints when it differs from its copy)."""
    staging: bool

    def to_fields(self) -> list:
        return [self.epoch, self.rank, self.incarnation, int(self.staging)]

    @classmethod
    def from_fields(cls, f: list) -> Ready:
        return cls(
            epoch=_epoch(f[0]), rank=_int("rank", f[1], 0, MAX_RANKS), incarnation=f[2], staging=_flag("staging", f[3])
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class Claim:
    """A prefill rank's claimed slot: it sends once every decode rank answered ``nonce``, issuing no engine call
    after ``window_ms`` from the claim."""

    KIND = Kind.CLAIM
    epoch: str
    rank: int
    incarnation: int
    window_ms: int
    """Milliseconds after the claim in which the rank may still issue engine calls (its deadline)."""
    call_timeout_ms: int
    """Longest an engine call of the rank may run (Mooncake: ``MC_TRANSFER_TIMEOUT`` + 1 ns per byte)."""
    nonce: str
    """Fresh per claim (:func:`dtkv.transfer.protocol.new_nonce`): what every decode rank holding the attempt
    answers (:class:`Answer`) before any byte is sent."""

    def to_fields(self) -> list:
        return [self.epoch, self.rank, self.incarnation, self.window_ms, self.call_timeout_ms, self.nonce]

    @classmethod
    def from_fields(cls, f: list) -> Claim:
        return cls(
            epoch=_epoch(f[0]),
            rank=_int("rank", f[1], 0, MAX_RANKS),
            incarnation=f[2],
            window_ms=_int("window_ms", f[3], 0, 1 << 40),
            call_timeout_ms=_int("call_timeout_ms", f[4], 0, 1 << 40),
            nonce=_nonce(f[5]),
        )

    @property
    def grace_s(self) -> float:
        """How long after an abort the rank's abandoned calls may still write."""
        return (self.window_ms + self.call_timeout_ms) / 1e3


@dataclass(frozen=True, kw_only=True, slots=True)
class Answer:
    """Decode rank ``decode_rank`` holds the attempt and answers prefill rank ``prefill_rank``'s claim ``nonce``
    (the liveness proof prefill waits for before sending; with a secret, only a live decode can write it)."""

    KIND = Kind.ANSWER
    epoch: str
    prefill_rank: int
    decode_rank: int
    nonce: str
    incarnation: int
    """The decode rank's endpoint incarnation (prefill sends only to the buffers that incarnation published)."""
    staging: bool = False
    """Whether the decode rank's staging region is granted to the attempt."""

    def to_fields(self) -> list:
        return [self.epoch, self.prefill_rank, self.decode_rank, self.nonce, self.incarnation, int(self.staging)]

    @classmethod
    def from_fields(cls, f: list) -> Answer:
        return cls(
            epoch=_epoch(f[0]),
            prefill_rank=_int("prefill_rank", f[1], 0, MAX_RANKS),
            decode_rank=_int("decode_rank", f[2], 0, MAX_RANKS),
            nonce=_nonce(f[3]),
            incarnation=f[4],
            staging=_flag("staging", f[5]),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class Aborted:
    """A slot closed by a failing decode receiver ``by`` before its rank claimed it."""

    KIND = Kind.ABORTED
    epoch: str
    by: str

    def to_fields(self) -> list:
        return [self.epoch, self.by]

    @classmethod
    def from_fields(cls, f: list) -> Aborted:
        return cls(epoch=_epoch(f[0]), by=_text("by", f[1], nonempty=True, limit=64))


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class SendStart:
    """What a prefill rank announces before sending: its positions and what decode must unpack."""

    KIND = Kind.START
    rank: int
    positions: np.ndarray
    """Positions this rank sends (its owned pages: the explicit logical positions)."""
    unpack: dict[int, tuple[StageCopy, ...]] = field(default_factory=dict)
    """decode rank -> staging copies decode applies, one layer group at a time, as the groups land."""
    layer_bounds: np.ndarray = field(default_factory=lambda: np.zeros(2, dtype=np.int64))
    """int64 ``[num_layer_groups + 1]``: the layer groups (:attr:`dtkv.transfer.RequestPlan.layer_bounds`)."""

    def to_fields(self) -> list:
        copies = [(d, c) for d, cs in sorted(self.unpack.items()) for c in cs]
        indptr = np.cumsum([0] + [int(c.local_pages.shape[0]) for _, c in copies])
        pages = np.concatenate([c.local_pages for _, c in copies]) if copies else np.zeros(0, np.int64)
        return [
            self.rank,
            self.positions,
            self.layer_bounds,
            [d for d, _ in copies],
            [c.name for _, c in copies],
            [c.offset for _, c in copies],
            indptr,
            pages,
        ]

    @classmethod
    def from_fields(cls, f: list) -> SendStart:
        rank, positions, bounds, ranks, names, offsets, indptr, pages = f
        n = len(names)
        if not (ranks.shape[0] == offsets.shape[0] == n and indptr.shape[0] == n + 1):
            raise WireError(f"staging copies must have one rank, name, offset and extent each, got {n} names")
        if int(indptr[0]) != 0 or np.any(np.diff(indptr) < 0) or int(indptr[-1]) != pages.shape[0]:
            raise WireError("staging copy extents must be a non-decreasing indptr from 0 to the page count")
        if bounds.shape[0] < 2 or int(bounds[0]) != 0 or np.any(np.diff(bounds) <= 0):
            raise WireError("layer_bounds must rise strictly from 0 with at least one layer group")
        _arr("layer_bounds", bounds, 0, 1 << 20)
        _arr("positions", positions, 0, MAX_PAGES)
        _arr("staging pages", pages, 0, MAX_PAGES)
        _arr("staging offsets", offsets, 0, MAX_ADDR)
        _arr("staging ranks", ranks, 0, MAX_RANKS)
        unpack: dict[int, list[StageCopy]] = {}
        for i in range(n):
            copy = StageCopy(
                name=_text("buffer name", names[i], nonempty=True, limit=128),
                offset=int(offsets[i]),
                local_pages=pages[int(indptr[i]) : int(indptr[i + 1])],
            )
            unpack.setdefault(int(ranks[i]), []).append(copy)
        return cls(
            rank=_int("rank", rank, 0, MAX_RANKS),
            positions=positions,
            layer_bounds=bounds,
            unpack={d: tuple(c) for d, c in unpack.items()},
        )


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class SendOutcome:
    """What a prefill rank reports after sending its share of a request (or failing to)."""

    KIND = Kind.OUTCOME
    rank: int
    ok: bool
    error: str = ""
    num_entries: int = 0
    num_calls: int = 0
    num_bytes: int = 0
    plan_entries: int = 0
    """Entries of the whole request (every sender)."""
    min_entries: int = 0
    """The minimum any plan of the request needs."""

    def to_fields(self) -> list:
        return [
            self.rank,
            int(self.ok),
            self.error[:MAX_TEXT],
            self.num_entries,
            self.num_calls,
            self.num_bytes,
            self.plan_entries,
            self.min_entries,
        ]

    @classmethod
    def from_fields(cls, f: list) -> SendOutcome:
        counts = [
            _int(name, v, 0, 1 << 62)
            for name, v in zip(("num_entries", "num_calls", "num_bytes", "plan_entries", "min_entries"), f[3:])
        ]
        return cls(
            rank=_int("rank", f[0], 0, MAX_RANKS),
            ok=_flag("ok", f[1]),
            error=_text("error", f[2]),
            num_entries=counts[0],
            num_calls=counts[1],
            num_bytes=counts[2],
            plan_entries=counts[3],
            min_entries=counts[4],
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class OpenList:
    """The attempts a rank holds open: ``(request_id, epoch, num_prefill, num_decode)`` each, and ``by``: the uid
    of the incarnation that holds them, then those of the dead ones whose attempts it adopted and still holds (a
    restart finishes the slots an ``ABORTED`` of one of these uids closed)."""

    KIND = Kind.OPEN_LIST
    by: tuple[str, ...]
    attempts: tuple[tuple[str, str, int, int], ...] = ()

    def to_fields(self) -> list:
        a = self.attempts
        return [list(self.by), [x[0] for x in a], [x[1] for x in a], [x[2] for x in a], [x[3] for x in a]]

    @classmethod
    def from_fields(cls, f: list) -> OpenList:
        by, rids, epochs, num_p, num_d = f
        if not len(rids) == len(epochs) == num_p.shape[0] == num_d.shape[0]:
            raise WireError("open attempts must have a request id, epoch and party counts each")
        if not by:
            raise WireError("an open list must name the incarnation that holds it, got no uid")
        _arr("num_prefill", num_p, 1, MAX_RANKS)
        _arr("num_decode", num_d, 1, MAX_RANKS)
        return cls(
            by=tuple(_text("by", u, nonempty=True, limit=64) for u in by),
            attempts=tuple(
                (_text("request_id", r, nonempty=True, limit=256), _epoch(e), int(p), int(d))
                for r, e, p, d in zip(rids, epochs, num_p, num_d)
            ),
        )


# ---------------------------------------------------------------------------------------------------- agents
@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class AgentRecord:
    """A NIXL agent's metadata, as a rank publishes it under ``{role}/{rank}/agent`` (NIXL engines only).

    ``metadata`` is NIXL's own serialization of the agent (``nixl_agent.get_agent_metadata()``: its UCX worker
    address and the remote keys of its registered memory); dtkv hands it to ``add_remote_agent`` only after the
    record's fields checked out (and, with a secret, its signature). ``regions`` is the same memory in dtkv's terms,
    so that the writer checks every destination against it before NIXL sees the request.
    """

    KIND = Kind.AGENT
    name: str
    generation: int
    """Counts the engine's registrations and unregistrations: a reader reloads a record of a newer generation."""
    metadata: bytes
    region_addr: np.ndarray
    """int64 ``[num_regions]``: base address of each registered region, ascending."""
    region_bytes: np.ndarray
    """int64 ``[num_regions]``: its length in bytes (> 0)."""
    region_device: np.ndarray
    """int64 ``[num_regions]``: -1 for host memory, else the CUDA device index."""

    def to_fields(self) -> list:
        return [self.name, self.generation, self.metadata, self.region_addr, self.region_bytes, self.region_device]

    @classmethod
    def from_fields(cls, f: list) -> AgentRecord:
        name, generation, metadata, addr, nbytes, device = f
        if not AGENT_NAME.fullmatch(name):
            raise WireError(f"agent name must match {AGENT_NAME.pattern}, got {name[:40]!r}")
        if not 1 <= len(metadata) <= MAX_AGENT_METADATA:
            raise WireError(f"agent metadata must hold 1..{MAX_AGENT_METADATA} bytes, got {len(metadata)}")
        n = addr.shape[0]
        if n > MAX_REGIONS or not nbytes.shape[0] == device.shape[0] == n:
            raise WireError(f"regions must be at most {MAX_REGIONS} with an address, a length and a device each")
        _arr("region_addr", addr, 1, MAX_REGION_ADDR)
        _arr("region_bytes", nbytes, 1, MAX_REGION_ADDR)
        _arr("region_device", device, -1, 1 << 10)
        if n and (np.any(np.diff(addr) <= 0) or np.any(addr[:-1] + nbytes[:-1] > addr[1:])):
            raise WireError("regions must be ascending and disjoint")
        return cls(
            name=name,
            generation=_int("generation", generation, 0, 1 << 62),
            metadata=bytes(metadata),
            region_addr=addr,
            region_bytes=nbytes,
            region_device=device,
        )
