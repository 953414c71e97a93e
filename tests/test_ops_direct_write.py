"""``dtkv::direct_write``: a rank's own rows go straight into its own pages, or nothing is written at all.

Contract: with a page-aligned split every row lands at ``pool[local_index(page), offset]`` (bitwise, no
tolerance); ``page_aligned=False``, a foreign page or an out-of-range location raises before any byte changes;
compiled code stays sync-free (foreign rows skipped) unless ``DTKV_DEBUG`` asks for the synchronizing check.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from dtkv import PageOwnership, debug_mode
from dtkv.ops import direct_write
from tests.ops_reference import (
    BACKENDS,
    DEVICES,
    OWNERSHIP_KINDS,
    as_kind,
    assert_same_bytes,
    backend_ok,
    ref_write_rows,
    skip_unless,
)


def _own_rows(own: PageOwnership, rank: int, ps: int, n_tokens: int, dim: int, seed: int = 0):
    """Rows and locations of the first ``n_tokens`` tokens of ``rank``'s pages (page-aligned split)."""
    pages = own.local_pages(rank)
    t = torch.arange(min(n_tokens, pages.numel() * ps))
    locs = pages[t // ps] * ps + t % ps
    rows = torch.randn(t.numel(), dim, generator=torch.Generator().manual_seed(seed))
    return rows, locs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("cp", "num_pages", "layout", "ps", "n"),
    [(1, 2, "interleave", 1, 1), (2, 7, "interleave", 16, 45), (3, 8, "block", 64, 150), (2, 4, "block", 16, 16)],
    ids=["n1-ps1", "partial-ps16", "block-ps64", "one-page"],
)
def test_direct_write_vs_reference(device, backend, cp, num_pages, layout, ps, n):
    skip_unless(backend, device)
    own = PageOwnership(cp, num_pages, layout)
    for rank in range(cp):
        rows, locs = _own_rows(own, rank, ps, n, 24, seed=rank)
        pool = torch.zeros(own.num_local_pages(rank), ps, 24, dtype=torch.bfloat16)
        expect = ref_write_rows(pool, rows.bfloat16(), locs, own, rank)
        pool = pool.to(device)
        direct_write(pool, rows.bfloat16().to(device), locs.int().to(device), own, rank, page_aligned=True,
                     backend=backend)  # fmt: skip
        assert_same_bytes(pool, expect, f"rank {rank}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("what", "locs", "page_aligned", "msg"),
    [
        ("unaligned split", [0, 1], False, "direct_write needs a page-aligned CP split"),
        ("foreign page", [0, 1, 2, 3, 4], True, "locs[2]=2 is in logical page 1, owned by rank 1, not by rank 0"),
        ("out of range", [0, 1, 40], True, "got locs[2]=40"),
        ("below -1", [-3, 1], True, "got locs[0]=-3"),
    ],
)
def test_rejects_leaving_pool_unchanged(backend, what, locs, page_aligned, msg):
    skip_unless(backend, "cpu")
    own = PageOwnership(2, 10, "interleave")  # page_size 2: rank 0 owns pages 0 2 4 6 8 (locs 0-1, 4-5, ...)
    pool = torch.randn(5, 2, 6)
    before = pool.clone()
    locs_t = torch.tensor(locs)
    with pytest.raises(ValueError, match=re.escape(msg)):
        direct_write(pool, torch.randn(len(locs), 6), locs_t, own, 0, page_aligned=page_aligned, backend=backend)
    assert_same_bytes(pool, before, "pool changed")


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    skip_unless(backend, "cpu")
    args = (torch.randn(3, 4, 8), torch.randn(5, 8), torch.tensor([0, 1, 9, -1, 17]), 2, 6, 0, 0, True, backend)
    torch.library.opcheck(torch.ops.dtkv.direct_write.default, args)


@pytest.mark.parametrize("kind", OWNERSHIP_KINDS)
def test_compiled_is_sync_free_and_debug_checks(kind):
    """One graph; without DTKV_DEBUG a foreign row is skipped silently, with it the compiled call raises."""
    backend = "triton" if backend_ok("triton", "cpu") else "torch"
    po = PageOwnership(2, 6, "interleave")
    own = as_kind(po, kind)
    cnt = CompileCounterWithBackend("aot_eager")

    def step(pool, rows, locs):
        direct_write(pool, rows, locs, own, 0, page_aligned=True, backend=backend)
        return pool

    compiled = torch.compile(step, backend=cnt, fullgraph=True)
    rows, good = torch.randn(4, 8), torch.tensor([0, 1, 8, 9])  # page_size 4: pages 0 and 2 belong to rank 0
    pool = compiled(torch.zeros(3, 4, 8), rows, good)
    assert cnt.frame_count == 1
    assert_same_bytes(pool, ref_write_rows(torch.zeros(3, 4, 8), rows, good, po, 0))

    foreign = torch.tensor([0, 1, 4, 9])  # loc 4 is on page 1 (rank 1): skipped, no error, no sync
    pool = compiled(torch.zeros(3, 4, 8), rows, foreign)
    assert_same_bytes(pool, ref_write_rows(torch.zeros(3, 4, 8), rows, foreign, po, 0))

    torch._dynamo.reset()
    with debug_mode():
        debug_compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
        pool = torch.zeros(3, 4, 8)
        with pytest.raises(ValueError, match=re.escape("locs[2]=4 is in logical page 1, owned by rank 1")):
            debug_compiled(pool, rows, foreign)
        assert not pool.any(), "nothing may be written when the debug check fails"
