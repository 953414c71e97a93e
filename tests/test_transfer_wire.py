"""The store value format: every record round-trips; anything malformed, unsigned or forged is a ``WireError``."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dtkv import PageOwnership
from dtkv.transfer import StageCopy
from dtkv.transfer.messages import (
    Aborted,
    AgentRecord,
    Answer,
    Claim,
    DstRequest,
    OpenList,
    Ready,
    SendOutcome,
    SendStart,
    SlotOpen,
    endpoint_fields,
    endpoint_from_fields,
)
from dtkv.transfer.wire import MAGIC, MAX_ITEMS, Kind, WireError, pack, unpack
from tests._transfer import shards

EPOCH = "0123456789abcdef"
NONCE = "00112233445566778899aabbccddeeff"
KEY = "req/r/0123456789abcdef/start/0"


def _records():
    return [
        DstRequest(
            request_id="r",
            epoch=EPOCH,
            dst_pages=np.array([3, 1, 2]),
            num_tokens=9,
            dst_meta_slot=None,
            num_prefill=2,
            num_decode=3,
            timeout_ms=5000,
        ),
        SlotOpen(epoch=EPOCH),
        Ready(epoch=EPOCH, rank=2, incarnation=12345, staging=True),
        Claim(epoch=EPOCH, rank=1, incarnation=7, window_ms=3000, call_timeout_ms=11000, nonce=NONCE),
        Answer(epoch=EPOCH, prefill_rank=1, decode_rank=2, nonce=NONCE, incarnation=-5, staging=True),
        Aborted(epoch=EPOCH, by="decode-00ff"),
        SendStart(
            rank=1,
            positions=np.array([0, 2, 5]),
            layer_bounds=np.array([0, 2, 4]),
            unpack={
                0: (StageCopy(name="kv", offset=64, local_pages=np.array([4, 1])),),
                2: (
                    StageCopy(name="index", offset=0, local_pages=np.array([0])),
                    StageCopy(name="kv", offset=8, local_pages=np.zeros(0, np.int64)),
                ),
            },
        ),
        SendOutcome(
            rank=3,
            ok=False,
            error="TransferError: boom \u2013 unicode",
            num_entries=4,
            num_calls=1,
            num_bytes=1 << 40,
            plan_entries=9,
            min_entries=2,
        ),
        OpenList(by=("decode-00000000000000ab",), attempts=(("a", EPOCH, 2, 1), ("b", "fedcba9876543210", 4, 4))),
        AgentRecord(
            name="dtkv-17-00ff00ff00ff",
            generation=3,
            metadata=bytes(range(256)) + b"\0nixlSerDes",  # opaque bytes, NULs and all
            region_addr=np.array([4096, 1 << 40]),
            region_bytes=np.array([4096, 7]),
            region_device=np.array([-1, 0]),
        ),
    ]


def _agent(**kw) -> AgentRecord:
    fields = dict(name="dtkv-1-ab", generation=1, metadata=b"md", region_addr=np.array([32, 64]),
                  region_bytes=np.array([8, 8]), region_device=np.array([-1, -1]))  # fmt: skip
    return AgentRecord(**{**fields, **kw})


def _same(a, b) -> bool:
    for name in a.__dataclass_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, np.ndarray):
            if not np.array_equal(x, y):
                return False
        elif isinstance(x, dict):
            if sorted(x) != sorted(y) or any(
                len(x[k]) != len(y[k])
                or any(
                    c.name != d.name or c.offset != d.offset or not np.array_equal(c.local_pages, d.local_pages)
                    for c, d in zip(x[k], y[k])
                )
                for k in x
            ):
                return False
        elif x != y:
            return False
    return True


class TestRoundTrip:
    @pytest.mark.parametrize("secret", [None, b"k"], ids=["plain", "signed"])
    @pytest.mark.parametrize("record", _records(), ids=lambda r: type(r).__name__)
    def test_record_round_trips(self, record, secret):
        raw = pack(record.KIND, record.to_fields(), key=KEY, secret=secret)
        kind, fields = unpack(raw, key=KEY, kinds=record.KIND, secret=secret)
        assert kind == record.KIND and _same(type(record).from_fields(fields), record)

    @pytest.mark.parametrize("page_major", [False, True], ids=["layer_major", "page_major"])
    def test_endpoint_round_trips(self, page_major):
        own = PageOwnership(3, 17, "block")
        shard = shards(own, staging_bytes=4096, meta_num_rows=2, meta_row_bytes=16, page_major=page_major)[2]
        ep = shard.endpoint("decode", "127.0.0.1:15000", incarnation=99)
        assert all(b.page_major is page_major for b in ep.buffers)
        raw = pack(Kind.ENDPOINT, endpoint_fields(ep), key="decode/2", secret=b"k")
        _, fields = unpack(raw, key="decode/2", kinds=Kind.ENDPOINT, secret=b"k")
        assert endpoint_from_fields(fields) == ep


class TestRejects:
    def _raw(self, secret=None):
        r = _records()[0]
        return pack(r.KIND, r.to_fields(), key=KEY, secret=secret)

    @pytest.mark.parametrize(
        "mutate,match",
        [
            (lambda b: b[:5], r"value must hold at least a 12-byte header, got 5 bytes"),
            (lambda b: b"PKL!" + b[4:], r"value must start with b'DTKV', got b'PKL!' \(not a dtkv value\)"),
            (lambda b: b[:4] + bytes([1]) + b[5:], r"value must be of wire version 4, got version 1"),
            (lambda b: b[:5] + bytes([77]) + b[6:], r"value must be of kind \['REQUEST'\], got kind unknown \(77\)"),
            (
                lambda b: b[:5] + bytes([int(Kind.START)]) + b[6:],
                r"value must be of kind \['REQUEST'\], got kind START",
            ),
            (lambda b: b[:6] + struct.pack("<H", 6) + b[8:], r"value flags must be 0 or 1, got 6"),
            (lambda b: b + b"\0", r"value must be \d+ bytes by its header, got \d+"),
            (lambda b: b[:12] + struct.pack("<q", MAX_ITEMS + 1) + b[20:], r"value holds a count of 16777217"),
            (lambda b: b[:12] + struct.pack("<q", -1) + b[20:], r"value holds a count of -1"),
            (lambda b: b[:20] + b"\xff" + b[21:], r"value holds a string that is not UTF-8"),
        ],
        ids=[
            "short",
            "magic",
            "version",
            "unknown-kind",
            "other-kind",
            "flags",
            "length",
            "huge-count",
            "negative-count",
            "utf8",
        ],
    )
    def test_rejects_malformed(self, mutate, match):
        with pytest.raises(WireError, match=match):
            unpack(mutate(self._raw()), key=KEY, kinds=Kind.REQUEST, secret=None)

    def test_rejects_a_blob_longer_than_the_value(self):
        raw = bytearray(pack(Kind.AGENT, _agent().to_fields(), key=KEY, secret=None))
        at = 12 + 8 + len("dtkv-1-ab") + 8  # header, the name, the generation: the blob's length field
        raw[at : at + 8] = struct.pack("<q", 1 << 20)
        with pytest.raises(WireError, match=r"value holds a count of 1048576, which must be in"):
            unpack(bytes(raw), key=KEY, kinds=Kind.AGENT, secret=None)

    def test_rejects_trailing_bytes_inside_the_body(self):
        raw = pack(Kind.SLOT_OPEN, [EPOCH], key=KEY, secret=None) + b"\0" * 8
        raw = raw[:8] + struct.pack("<I", len(raw) - 12) + raw[12:]
        with pytest.raises(WireError, match=r"value has 8 trailing bytes after its SLOT_OPEN fields"):
            unpack(raw, key=KEY, kinds=Kind.SLOT_OPEN, secret=None)

    def test_authentication(self):
        signed, plain = self._raw(b"k"), self._raw()
        assert unpack(signed, key=KEY, kinds=Kind.REQUEST, secret=b"k")
        with pytest.raises(WireError, match=r"must be signed \(DTKV_TRANSFER_SECRET is set\)"):
            unpack(plain, key=KEY, kinds=Kind.REQUEST, secret=b"k")
        with pytest.raises(WireError, match=r"is signed but no DTKV_TRANSFER_SECRET is set here"):
            unpack(signed, key=KEY, kinds=Kind.REQUEST, secret=None)
        for forged in (signed[:-1] + bytes([signed[-1] ^ 1]), signed[:30] + bytes([signed[30] ^ 1]) + signed[31:]):
            with pytest.raises(WireError, match=r"HMAC does not verify"):
                unpack(forged, key=KEY, kinds=Kind.REQUEST, secret=b"k")
        with pytest.raises(WireError, match=r"HMAC does not verify"):
            unpack(signed, key=KEY.replace("start/0", "start/1"), kinds=Kind.REQUEST, secret=b"k")
        with pytest.raises(WireError, match=r"HMAC does not verify"):
            unpack(signed, key=KEY, kinds=Kind.REQUEST, secret=b"other")

    @pytest.mark.parametrize(
        "record,match",
        [
            (DstRequest(request_id="r", epoch="xyz", dst_pages=np.array([1])), r"epoch must be 16 hex digits"),
            (DstRequest(request_id="r", epoch=EPOCH, dst_pages=np.array([-1])), r"dst_pages must hold values in"),
            (DstRequest(request_id="", epoch=EPOCH, dst_pages=np.array([1])), r"request_id must be a non-empty"),
            (Ready(epoch=EPOCH, rank=-2, incarnation=0, staging=False), r"rank must be in \[0, 65536\], got rank=-2"),
            (SendOutcome(rank=0, ok=True, num_bytes=-5), r"num_bytes must be in \[0, \d+\], got num_bytes=-5"),
            (
                Claim(epoch=EPOCH, rank=0, incarnation=1, window_ms=1, call_timeout_ms=1, nonce="abc"),
                r"nonce must be 32 hex digits, got 'abc'",
            ),
            (
                Answer(epoch=EPOCH, prefill_rank=0, decode_rank=0, nonce=NONCE.upper(), incarnation=1),
                r"nonce must be 32 hex digits",
            ),
            (SendStart(rank=0, positions=np.array([0]), layer_bounds=np.array([0, 0])), r"layer_bounds must rise"),
            (
                OpenList(by=("decode-00000000000000ab",), attempts=(("a", EPOCH, 0, 1),)),
                r"num_prefill must hold values in \[1, 65536\]",
            ),
            (_agent(region_addr=np.array([64, 32])), r"regions must be ascending and disjoint"),
            (_agent(region_bytes=np.array([40, 8])), r"regions must be ascending and disjoint"),  # [32, 72) > 64
            (_agent(region_device=np.array([-2, 0])), r"region_device must hold values in \[-1, 1024\]"),
            (_agent(name="a/b"), r"agent name must match"),
            (_agent(metadata=b""), r"agent metadata must hold 1\.\."),
        ],
        ids=[
            "epoch",
            "page",
            "request-id",
            "rank",
            "count",
            "claim-nonce",
            "answer-nonce",
            "bounds",
            "parties",
            "agent-order",
            "agent-overlap",
            "agent-device",
            "agent-name",
            "agent-metadata",
        ],  # fmt: skip
    )
    def test_rejects_out_of_range_records(self, record, match):
        _, fields = unpack(
            pack(record.KIND, record.to_fields(), key=KEY, secret=None), key=KEY, kinds=record.KIND, secret=None
        )
        with pytest.raises(WireError, match=match):
            type(record).from_fields(fields)

    def test_rejects_inconsistent_staging_copies(self):
        st = _records()[6]
        _, fields = unpack(pack(st.KIND, st.to_fields(), key=KEY, secret=None), key=KEY, kinds=st.KIND, secret=None)
        fields[6] = np.array([0, 2, 9, 3])  # extents past the page list
        with pytest.raises(WireError, match=r"staging copy extents must be a non-decreasing indptr"):
            SendStart.from_fields(fields)

    def test_rejects_bad_endpoints(self):
        ep = shards(PageOwnership(2, 8))[1].endpoint("prefill", "s:1")
        for i, value, match in [
            (0, "evil", r"role must be 'prefill' or 'decode'"),
            (6, "zigzag", r"ownership scheme must be 'interleave' or 'block'"),
            (1, 5, r"rank must be in \[0, 1\], got rank=5"),
            (9, [1], r"buffers must be 1..64 with one value of each field per buffer"),
            (19, [0], r"buffers must be 1..64 with one value of each field per buffer"),
            (19, [1, 2], r"page_major must hold values in \[0, 1\], got \[1, 2\]"),
            (19, [-1, 0], r"page_major must hold values in \[0, 1\], got \[-1, 0\]"),
        ]:
            _, fields = unpack(
                pack(Kind.ENDPOINT, endpoint_fields(ep), key="k", secret=None),
                key="k",
                kinds=Kind.ENDPOINT,
                secret=None,
            )
            fields[i] = value if i not in (9, 19) else np.asarray(value)
            with pytest.raises(WireError, match=match):
                endpoint_from_fields(fields)


class TestFuzz:
    @settings(max_examples=200, deadline=None)
    @given(st.binary(max_size=256))
    def test_random_bytes_are_refused_cleanly(self, data):
        with pytest.raises(WireError):
            unpack(MAGIC + data, key=KEY, kinds=tuple(Kind), secret=b"k")

    @settings(max_examples=200, deadline=None)
    @given(st.integers(min_value=0, max_value=9), st.integers(min_value=0), st.integers(min_value=1, max_value=255))
    def test_mutated_records_decode_or_raise_wire_error(self, which, where, flip):
        """A record with one byte changed either still decodes to in-range values or raises ``WireError``."""
        record = _records()[which]
        raw = bytearray(pack(record.KIND, record.to_fields(), key=KEY, secret=None))
        raw[where % len(raw)] ^= flip
        try:
            kind, fields = unpack(bytes(raw), key=KEY, kinds=tuple(Kind), secret=None)
            {r.KIND: type(r) for r in _records()}[kind].from_fields(fields)
        except WireError:
            pass
