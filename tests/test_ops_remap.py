"""``dtkv::remap``: logical page ids / token locations / top-k indices -> gathered-buffer coordinates.

Contract: ``x -> page_map[x // S] * S + x % S``; ``-1``, pages missing from the buffer and pages outside
``page_map`` all give ``-1``; shape and dtype are kept. Integer arithmetic: exact, compared with ``torch.equal``.
"""

from __future__ import annotations

import re

import pytest
import torch

from dtkv import PageOwnership
from dtkv.ops import plan_pack, remap
from tests.ops_reference import BACKENDS, DEVICES, ref_remap, skip_unless


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
@pytest.mark.parametrize("shape", [(1,), (3, 7), (2, 1, 1030)], ids=["one", "2d", "3d-multiblock"])
def test_remap_vs_reference(device, backend, page_size, dtype, shape):
    skip_unless(backend, device)
    own = PageOwnership(3, 12, "interleave")
    plan = plan_pack(torch.tensor([11, 0, 5, 6, 2, -1, 9]), own)
    g = torch.Generator().manual_seed(page_size)
    idx = torch.randint(-1, 13 * page_size, shape, generator=g)  # includes pages beyond num_pages
    idx = idx.to(dtype)
    out = remap(idx.to(device), plan.page_map.to(device), page_size=page_size, backend=backend)
    assert out.dtype == dtype and out.shape == idx.shape
    assert torch.equal(out.cpu(), ref_remap(idx, plan.page_map.tolist(), page_size))


@pytest.mark.parametrize("backend", BACKENDS)
def test_allows_non_contiguous_and_empty(backend):
    skip_unless(backend, "cpu")
    page_map = torch.tensor([3, -1, 0, 1], dtype=torch.int32)
    idx = torch.tensor([[0, 1, 2, 3], [7, 8, 9, -1]]).t()  # non-contiguous
    expect = ref_remap(idx.contiguous(), page_map.tolist(), 2)
    assert torch.equal(remap(idx, page_map, page_size=2, backend=backend), expect)
    assert remap(torch.zeros(0, 3, dtype=torch.int64), page_map, backend=backend).shape == (0, 3)


def test_rejects_bad_input():
    pm = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(TypeError, match=re.escape("indices must have dtype [torch.int64, torch.int32]")):
        remap(torch.zeros(3), pm)
    with pytest.raises(ValueError, match=re.escape("page_map must have 1 dims, got page_map.shape=(2, 2)")):
        remap(torch.zeros(3, dtype=torch.int64), pm.view(2, 2))
    with pytest.raises(ValueError, match=re.escape("page_size must be >= 1, got page_size=0")):
        remap(torch.zeros(3, dtype=torch.int64), pm, page_size=0)
