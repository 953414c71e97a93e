"""``dtkv::write_owned``: every rank keeps exactly its pages' rows, bit for bit, on every backend.

Contract: rows whose page the rank owns land at ``pool[local_index(page), offset]``; ``-1`` and foreign rows
touch nothing; bad input raises before any byte of the pool changes. No tolerances: the op copies bytes.
"""

from __future__ import annotations

import pytest
import torch

from dtkv import PageOwnership
from dtkv.ops import write_owned
from tests.ops_reference import (
    BACKENDS,
    DEVICES,
    assert_same_bytes,
    ref_write_rows,
    scattered_locs,
    skip_unless,
)

CASES = [  # (cp, num_pages, layout, page_size, n rows)
    pytest.param(1, 3, "interleave", 1, 1, id="cp1-ps1-n1"),
    pytest.param(3, 7, "interleave", 16, 37, id="cp3-ps16-partial"),
    pytest.param(2, 5, "block", 64, 130, id="cp2-ps64-block"),
    pytest.param(4, 10, "block", 1, 9, id="cp4-ps1-block"),
]


def _rows(n: int, dim: int, dtype: torch.dtype, device: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:
        return torch.randint(0, 256, (n, dim), generator=g, dtype=torch.uint8).to(device)
    return torch.randn(n, dim, generator=g).to(dtype).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("cp", "num_pages", "layout", "ps", "n"), CASES)
@pytest.mark.parametrize("dtype,dim", [(torch.uint8, 656), (torch.bfloat16, 576)], ids=["fp8row", "bf16"])
def test_write_owned_vs_reference(device, backend, cp, num_pages, layout, ps, n, dtype, dim):
    skip_unless(backend, device)
    own = PageOwnership(cp, num_pages, layout)
    rows = _rows(n, dim, dtype, device)
    locs = scattered_locs(num_pages, ps, n, pad_every=5 if n > 5 else 0).to(device)
    for rank in range(cp):
        start = _rows(own.num_local_pages(rank) * ps, dim, dtype, "cpu", seed=rank + 1)
        pool = start.view(-1, ps, dim).to(device)
        write_owned(pool, rows, locs, own, rank, backend=backend)
        expect = ref_write_rows(start.view(-1, ps, dim), rows.cpu(), locs.cpu(), own, rank)
        assert_same_bytes(pool, expect, f"rank {rank}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_allows_strided_pool_view(device, backend):
    """A layer of a ``[layers, pages, S, D + pad]`` buffer: page and row strides differ from a packed pool."""
    skip_unless(backend, device)
    own, ps, dim = PageOwnership(2, 6, "interleave"), 4, 12
    buf = torch.zeros(3, 3, ps, dim + 4, dtype=torch.float32, device=device)
    pool = buf[1, :, :, :dim]
    rows = torch.randn(17, dim, device=device)
    locs = scattered_locs(6, ps, 17).to(device)
    write_owned(pool, rows, locs, own, 1, backend=backend)
    expect = ref_write_rows(torch.zeros(3, ps, dim), rows.cpu(), locs.cpu(), own, 1)
    assert_same_bytes(pool, expect)
    assert not buf[0].any() and not buf[2].any() and not buf[1, :, :, dim:].any(), "wrote outside the view"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_allows_empty_and_all_padding(backend):
    skip_unless(backend, "cpu")
    own = PageOwnership(2, 4, "interleave")
    pool = torch.ones(2, 2, 8)
    write_owned(pool, torch.zeros(0, 8), torch.zeros(0, dtype=torch.int64), own, 0, backend=backend)
    write_owned(pool, torch.zeros(3, 8), torch.full((3,), -1, dtype=torch.int32), own, 0, backend=backend)
    assert torch.equal(pool, torch.ones(2, 2, 8))


def test_rejects_unknown_backend():
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'torch', 'triton'\), got backend='cuda'"):
        write_owned(torch.zeros(1, 1, 1), torch.zeros(1, 1), torch.zeros(1, dtype=torch.int64), PageOwnership(1, 1),
                    0, backend="cuda")  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_allows_misaligned_rows_and_pool(backend):
    """Odd byte offsets force byte-wide words on one side: both sides then copy bytes."""
    skip_unless(backend, "cpu")
    own = PageOwnership(1, 3)
    buf = torch.zeros(3 * 2 * 16 + 1, dtype=torch.uint8)
    pool = buf[1:].view(3, 2, 16)  # storage offset 1: only uint8 words
    rows = torch.randint(0, 255, (4, 16), dtype=torch.uint8)
    locs = torch.tensor([5, 0, 2, 3])
    write_owned(pool, rows, locs, own, 0, backend=backend)
    assert_same_bytes(pool, ref_write_rows(torch.zeros(3, 2, 16, dtype=torch.uint8), rows, locs, own, 0))
    assert buf[0] == 0
