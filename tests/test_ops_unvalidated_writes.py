"""The row-write ops with ``validate=False`` (the compiled default without ``DTKV_DEBUG``): the mask alone keeps
every store inside this rank's pages.

Rows are skipped when their location is negative (``-1`` padding or any other negative value), when the page lies
past the logical pool, when another rank owns the page, and when the page's local index does not fit the pool
handed in; every other row lands, and every byte outside the landed rows keeps its value. Reference: a loop over
rows using only :class:`dtkv.PageOwnership`. Tolerances: none (bytes compared).
"""

from __future__ import annotations

import pytest
import torch

from dtkv import IndexerFp8Layout, MLAFp8Layout, PageOwnership
from dtkv.ops import direct_write, quantize_write_indexer_fp8, quantize_write_mla_fp8, write_owned
from tests.ops_reference import (
    BACKENDS,
    assert_same_bytes,
    ref_indexer_write,
    ref_mla_row,
    ref_write_rows,
    skip_unless,
)

PAGE_SIZE = 3
OWNERSHIPS = [PageOwnership(2, 5, "interleave"), PageOwnership(3, 7, "block"), PageOwnership(1, 4)]


def _locs(own: PageOwnership) -> torch.Tensor:
    """Every page of the pool (partly filled), plus -1, -4, the first page past the pool and a far one."""
    inside = [p * PAGE_SIZE + t for p in range(own.num_pages) for t in (0, 2) if (p + t) % 3]
    past = [own.num_pages * PAGE_SIZE, own.num_pages * PAGE_SIZE + 2, 10**6]
    locs = inside[:3] + [-1] + inside[3:6] + [-4] + past[:1] + inside[6:] + past[1:]
    return torch.tensor(locs, dtype=torch.int64)


def _kept(locs: torch.Tensor, own: PageOwnership, rank: int, num_local: int) -> torch.Tensor:
    """Boolean ``[N]``: the rows a rank's pool of ``num_local`` pages receives."""
    keep = []
    for loc in locs.tolist():
        page = loc // PAGE_SIZE
        keep.append(loc >= 0 and page < own.num_pages and own.owner(page) == rank and own.local_index(page) < num_local)
    return torch.tensor(keep, dtype=torch.bool)


def _sizes(own: PageOwnership, rank: int) -> list[int]:
    """Pool lengths: one page short of what the rank owns (its last owned page must be skipped), exact, and two
    spare pages (pages past the logical pool map into them and must be skipped all the same)."""
    n = own.num_local_pages(rank)
    return sorted({max(1, n - 1), n, n + 2})


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("own", OWNERSHIPS, ids=repr)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int32], ids=["bf16", "int32"])
def test_write_owned_skips_rows_outside_this_ranks_pool(backend, own, dtype):
    skip_unless(backend, "cpu")
    locs = _locs(own).to(torch.int32 if dtype == torch.int32 else torch.int64)
    g = torch.Generator().manual_seed(own.num_pages)
    rows = torch.randint(-100, 100, (locs.shape[0], 6), generator=g).to(dtype)
    for rank in range(own.cp_size):
        for num_local in _sizes(own, rank):
            pool = torch.randint(-100, 100, (num_local, PAGE_SIZE, 6), generator=g).to(dtype)
            want = ref_write_rows(pool, rows[_kept(locs, own, rank, num_local)],
                                  locs[_kept(locs, own, rank, num_local)], own, rank)  # fmt: skip
            write_owned(pool, rows, locs, own, rank, validate=False, backend=backend)
            assert_same_bytes(pool, want, f"rank {rank}, {num_local} local pages")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("own", OWNERSHIPS, ids=repr)
def test_direct_write_skips_rows_outside_this_ranks_pool(backend, own):
    skip_unless(backend, "cpu")
    locs = _locs(own)
    g = torch.Generator().manual_seed(own.num_pages)
    rows = torch.randn(locs.shape[0], 5, generator=g)
    for rank, num_local in [(r, n) for r in range(own.cp_size) for n in _sizes(own, r)]:
        pool = torch.randn(num_local, PAGE_SIZE, 5, generator=g)
        keep = _kept(locs, own, rank, num_local)
        want = ref_write_rows(pool, rows[keep], locs[keep], own, rank)
        direct_write(pool, rows, locs, own, rank, validate=False, backend=backend)
        assert_same_bytes(pool, want, f"rank {rank}")


MLA = MLAFp8Layout(page_size=PAGE_SIZE, kv_lora_rank=12, rope_dim=2, quant_block=6)
INDEXER = IndexerFp8Layout(page_size=PAGE_SIZE, head_dim=8)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("own", OWNERSHIPS, ids=repr)
def test_quantize_writes_skip_rows_outside_this_ranks_pool(backend, own):
    skip_unless(backend, "cpu")
    locs = _locs(own)
    g = torch.Generator().manual_seed(own.num_pages)
    kv = torch.randn(locs.shape[0], MLA.row_dim, generator=g)
    k = torch.randn(locs.shape[0], INDEXER.head_dim, generator=g)
    mla_rows = torch.stack([ref_mla_row(r, MLA) for r in kv])
    for rank, num_local in [(r, n) for r in range(own.cp_size) for n in _sizes(own, r)]:
        keep = _kept(locs, own, rank, num_local)
        pool = torch.randint(0, 256, (num_local, *MLA.page_shape), generator=g, dtype=torch.uint8)
        want = ref_write_rows(pool, mla_rows[keep], locs[keep], own, rank)
        quantize_write_mla_fp8(pool, kv, locs, own, rank, layout=MLA, validate=False, backend=backend)
        assert_same_bytes(pool, want, f"mla, rank {rank}")

        pool = torch.randint(0, 256, (num_local, *INDEXER.page_shape), generator=g, dtype=torch.uint8)
        want = ref_indexer_write(pool, k[keep], locs[keep], own, rank, INDEXER)
        quantize_write_indexer_fp8(pool, k, locs, own, rank, layout=INDEXER, validate=False, backend=backend)
        assert_same_bytes(pool, want, f"indexer, rank {rank}")


@pytest.mark.parametrize("own", OWNERSHIPS, ids=repr)
def test_direct_write_torch_reference_matches_the_loop(own):
    """The documented torch reference of ``dtkv::direct_write`` (the op itself stores through ``write_owned``'s)."""
    from dtkv.ops.direct_write import direct_write_torch

    locs = _locs(own)
    rows = torch.randn(locs.shape[0], 4, generator=torch.Generator().manual_seed(3))
    code = 0 if own.scheme == "interleave" else 1
    for rank, num_local in [(r, n) for r in range(own.cp_size) for n in _sizes(own, r)]:
        pool = torch.randn(num_local, PAGE_SIZE, 4)
        keep = _kept(locs, own, rank, num_local)
        want = ref_write_rows(pool, rows[keep], locs[keep], own, rank)
        direct_write_torch(pool, rows, locs, own.cp_size, own.num_pages, code, rank)
        assert_same_bytes(pool, want, f"rank {rank}")
