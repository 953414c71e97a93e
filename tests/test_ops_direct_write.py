"""``direct_write`` (``dtkv::write_owned`` with ``direct=True``): own rows straight into own pages, or nothing at all.

Contract: with a page-aligned split every row lands at ``pool[local_index(page), offset]`` (bitwise, no
tolerance); a foreign page or an out-of-range location raises before any byte changes (contract table);
compiled code stays sync-free (foreign rows skipped) unless ``DTKV_DEBUG`` asks for the synchronizing check.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from dtkv import PageOwnership, debug_mode
from dtkv.ops import direct_write, write_owned
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
        direct_write(pool, rows.bfloat16().to(device), locs.int().to(device), own, rank, backend=backend)
        assert_same_bytes(pool, expect, f"rank {rank}")


@pytest.mark.parametrize("kind", OWNERSHIP_KINDS)
def test_compiled_is_sync_free_and_debug_checks(kind):
    """One graph; without DTKV_DEBUG a foreign row is skipped silently, with it the compiled call raises."""
    backend = "triton" if backend_ok("triton", "cpu") else "torch"
    po = PageOwnership(2, 6, "interleave")
    own = as_kind(po, kind)
    cnt = CompileCounterWithBackend("aot_eager")

    def step(pool, rows, locs):
        direct_write(pool, rows, locs, own, 0, backend=backend)
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


def test_is_write_owned_direct_and_page_aligned_is_gone():
    """``direct_write`` is ``write_owned(..., direct=True)``; its 0.1 keyword ``page_aligned=`` was removed in 0.2
    (a direct write states a page-aligned split by itself)."""
    own = PageOwnership(2, 6, "interleave")
    rows, locs = _own_rows(own, 0, 4, 10, 8)
    expect = torch.zeros(3, 4, 8)
    write_owned(expect, rows, locs, own, 0, direct=True)
    assert_same_bytes(expect, ref_write_rows(torch.zeros(3, 4, 8), rows, locs, own, 0))
    pool = torch.zeros(3, 4, 8)
    direct_write(pool, rows, locs, own, 0)
    assert_same_bytes(pool, expect)
    with pytest.raises(TypeError, match="page_aligned"):
        direct_write(pool, rows, locs, own, 0, page_aligned=True)
    with pytest.raises(TypeError, match=re.escape("direct must be a bool, got direct=1")):
        write_owned(pool, rows, locs, own, 0, direct=1)
