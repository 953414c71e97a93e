"""dtkv.transfer.plan details the byte-level oracle of ``tests/test_transfer_descriptors.py`` does not see:
where staging regions start (8-byte aligned for whole-word pages, element-aligned otherwise) and
``disable_staging``."""

from __future__ import annotations

import dataclasses

import numpy as np

from dtkv import IndexerFp8Layout, MLALatentLayout, PageOwnership
from dtkv.transfer.descriptors import PlanOptions
from dtkv.transfer.plan import disable_staging, plan_request
from dtkv.transfer.shard import KVShard

# page bytes: latents 3 * 5 * 2 = 30 and 3 * 6 * 2 = 36 (not whole words, bf16 elements); indexer 3 * (4 + 4) = 24
LAYOUTS = {
    "a_latent": MLALatentLayout(page_size=3, kv_lora_rank=3, rope_dim=2),
    "b_latent": MLALatentLayout(page_size=3, kv_lora_rank=4, rope_dim=2),
    "c_index": IndexerFp8Layout(page_size=3, head_dim=4),
}


def _endpoints(role: str, ownership: PageOwnership, staging_bytes: int):
    return [
        KVShard.allocate(LAYOUTS, ownership, r, num_layers=3, staging_bytes=staging_bytes).endpoint(role, f"{role}{r}")
        for r in range(ownership.cp_size)
    ]


def test_staging_regions_start_aligned():
    pre = _endpoints("prefill", PageOwnership(2, 9), 1 << 14)
    dec = _endpoints("decode", PageOwnership(1, 9), 1 << 14)
    src, dst = np.array([0, 3, 5, 8, 1, 6, 2]), np.array([4, 0, 8, 2, 6, 1, 7])
    plan = plan_request(src, dst, prefill=pre, decode=dec, options=PlanOptions(staging="full"))
    copies = [c for s in plan.senders for c in s.pack] + [c for s in plan.senders for u in s.unpack.values() for c in u]
    assert copies and plan.staged_bytes > 0
    seen = set()
    for c in copies:
        buf = pre[0].buffer(c.name)
        align = 8 if buf.page_bytes % 8 == 0 else buf.elem_bytes
        assert c.offset % align == 0, (c.name, c.offset)
        seen.add((c.name, c.offset % 8 == 0))
    assert ("c_index", True) in seen
    assert ("b_latent", False) in seen  # element-aligned after the 30-byte pages of a_latent
    # the second region of a rank starts where the first ends, rounded up to its own alignment
    for s in plan.senders:
        ends = 0
        for c in s.pack:
            buf = pre[0].buffer(c.name)
            align = 8 if buf.page_bytes % 8 == 0 else buf.elem_bytes
            assert c.offset == -(-ends // align) * align
            ends = c.offset + 3 * len(c.local_pages) * buf.page_bytes


def test_disable_staging_zeroes_only_the_staging_capacity():
    eps = _endpoints("decode", PageOwnership(2, 6), 4096)
    off = disable_staging(eps)
    assert [e.staging_bytes for e in off] == [0, 0] and [e.staging_bytes for e in eps] == [4096, 4096]
    assert [dataclasses.replace(e, staging_bytes=4096) for e in off] == eps
