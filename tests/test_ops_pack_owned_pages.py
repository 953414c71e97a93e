"""``dtkv::pack_owned_pages`` and its plan: the concatenated send buffers are the owner-major gathered buffer.

Contract: for a page list identical on every rank, rank ``r``'s buffer holds its owned pages in list order, zero
padded to ``rows_per_rank``; ``page_map[p]`` is ``p``'s row in the concatenation, ``rows`` the row of each list position.
Checked bitwise (pages are copied, never converted) against a loop-built reference.
"""

from __future__ import annotations

import re

import pytest
import torch

from dtkv import PageOwnership
from dtkv.ops import gathered_page_table, pack_owned_pages, plan_pack
from tests.ops_reference import (
    BACKENDS,
    DEVICES,
    assert_same_bytes,
    ref_gathered,
    skip_unless,
)

LISTS = [
    pytest.param(1, 4, "interleave", [2], id="cp1-one-page"),
    pytest.param(2, 9, "interleave", [4, 1, 2, 7, -1, 4, 8], id="cp2-dup-pad"),
    pytest.param(3, 10, "block", [9, 0, 1, 2, 3, -1, -1], id="cp3-block-unbalanced"),
    pytest.param(4, 6, "interleave", [-1, -1], id="cp4-all-padding"),
    pytest.param(3, 11, "interleave", list(range(10, -1, -1)), id="cp3-all-reversed"),
]


@pytest.mark.parametrize(("cp", "num_pages", "layout", "pages"), LISTS)
def test_plan_vs_reference(cp, num_pages, layout, pages):
    own = PageOwnership(cp, num_pages, layout)
    full = torch.arange(num_pages, dtype=torch.float32)[:, None]
    _, rows_per_rank, page_map, rows = ref_gathered(full, pages, own)
    plan = plan_pack(torch.tensor(pages, dtype=torch.int32), own)
    assert plan.rows_per_rank == rows_per_rank and plan.num_gathered_rows == cp * rows_per_rank
    assert plan.page_map.dtype == torch.int32 and plan.page_map.tolist() == page_map
    assert plan.rows.tolist() == rows
    assert sum(plan.counts) == len({p for p in pages if p >= 0})
    pm, rw = gathered_page_table(torch.tensor(pages), own)
    assert torch.equal(pm, plan.page_map) and torch.equal(rw, plan.rows)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("cp", "num_pages", "layout", "pages"), LISTS)
@pytest.mark.parametrize(
    "page_shape,dtype",
    [((1, 656), torch.uint8), ((16, 576), torch.bfloat16), ((64 * 132,), torch.uint8), ((3, 5), torch.float32)],
    ids=["fp8-ps1", "bf16-ps16", "indexer-ps64", "odd"],
)
def test_pack_owned_pages_vs_reference(device, backend, cp, num_pages, layout, pages, page_shape, dtype):
    skip_unless(backend, device)
    own = PageOwnership(cp, num_pages, layout)
    g = torch.Generator().manual_seed(cp)
    full = torch.randint(0, 255, (num_pages, *page_shape), generator=g, dtype=torch.uint8)
    full = full if dtype == torch.uint8 else torch.randn(num_pages, *page_shape, generator=g).to(dtype)
    expect, rows_per_rank, _, _ = ref_gathered(full, pages, own)
    plan = plan_pack(torch.tensor(pages, device=device), own)
    bufs = []
    for r in range(cp):
        local = full[own.local_pages(r)].to(device)
        bufs.append(pack_owned_pages(local, plan, own, r, backend=backend))
        assert bufs[-1].shape == (rows_per_rank, *page_shape) and bufs[-1].dtype == dtype
    assert_same_bytes(torch.cat(bufs), expect)


@pytest.mark.parametrize("backend", BACKENDS)
def test_allows_strided_pool_and_tensor_pages(backend):
    """A layer view of a layered buffer (page stride != page size); pages given as a tensor (planned inline)."""
    skip_unless(backend, "cpu")
    own = PageOwnership(2, 8, "block")
    buf = torch.randn(4, 2, 3, 5)
    view = buf[:, 1]  # [4 local pages, 3, 5], page stride 30 (two layers interleaved per page)
    out = pack_owned_pages(view, torch.tensor([5, 0, 6]), own, 1, backend=backend)  # rank 1 owns 4..7
    assert_same_bytes(out, torch.stack([view[1], view[2]]))


def test_rejects_bad_input():
    own = PageOwnership(2, 8)
    with pytest.raises(ValueError, match=re.escape("pages must hold logical pages in [-1, 8) (-1 is padding), got")):
        plan_pack(torch.tensor([0, 8]), own)
    with pytest.raises(TypeError, match=re.escape("pages must have dtype")):
        plan_pack(torch.tensor([0.0]), own)
    plan = plan_pack(torch.tensor([0, 1]), own)
    with pytest.raises(ValueError, match=re.escape("pages was planned for PageOwnership(cp_size=2, num_pages=8")):
        pack_owned_pages(torch.zeros(4, 2), plan, PageOwnership(2, 8, "block"), 0)
    with pytest.raises(ValueError, match=re.escape("pool pages must be contiguous")):
        pack_owned_pages(torch.zeros(4, 2, 3).transpose(1, 2), plan, own, 0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("cp", "num_pages"), [(3, 4), (8, 49)], ids=["cp3-4pages", "cp8-49pages"])
def test_allows_rank_that_stores_no_pages(backend, cp, num_pages):
    """Block scheme with ``ceil(P / cp) * (cp - 1) >= P``: the last rank's pool is empty; it sends zero pages."""
    skip_unless(backend, "cpu")
    own = PageOwnership(cp, num_pages, "block")
    assert own.num_local_pages(cp - 1) == 0
    full = torch.randn(num_pages, 2, 3, generator=torch.Generator().manual_seed(cp))
    pages = [*range(num_pages - 1, -1, -2), -1]
    expect, rows_per_rank, _, _ = ref_gathered(full, pages, own)
    plan = plan_pack(torch.tensor(pages), own)
    bufs = [pack_owned_pages(full[own.local_pages(r)], plan, own, r, backend=backend) for r in range(cp)]
    assert bufs[-1].shape == (rows_per_rank, 2, 3) and not bufs[-1].any()
    assert_same_bytes(torch.cat(bufs), expect)


@pytest.mark.parametrize("rank", [-1, 3])
def test_rejects_rank_outside_the_group(rank):
    own = PageOwnership(3, 4, "block")
    plan = plan_pack(torch.tensor([0, 1, 2, 3]), own)
    with pytest.raises(ValueError, match=re.escape(f"rank must be in [0, cp_size=3), got rank={rank}")):
        pack_owned_pages(torch.zeros(2, 2, 3), plan, own, rank)


def test_rows_per_rank_is_the_one_name_of_the_send_rows():
    """``rows_per_rank`` is the largest per-rank count of owned pages in the list (0.1's ``max_count`` is gone)."""
    plan = plan_pack(torch.tensor([0, 2, 1]), PageOwnership(2, 4))
    assert plan.rows_per_rank == 2 and plan.counts == (2, 1) and not hasattr(plan, "max_count")
