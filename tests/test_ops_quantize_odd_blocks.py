"""The Triton quantize-write kernels on geometries whose blocks and dims are not powers of two.

The kernels pad every tile dimension to a power of two (``NBP``, ``QBP``, ``RP``, ``HP``) and mask the padding.
With a power-of-two ``quant_block`` or ``head_dim`` the padded and the real strides coincide, so an index that
uses one where the other belongs goes unseen; these layouts make them differ (``quant_block`` 3, 5, 12, 20, 24;
``head_dim`` 1, 7, 12, 20, 36; ``rope_dim`` 0, 2, 6, 10; page sizes 1, 3, 5; a pool with a page stride larger
than a page). The Triton backend is asked for explicitly and watched: its kernel must launch, and the torch path
must not run, so the comparison cannot pass through a silent fallback.

Tolerances: none. Both backends and the independent table-driven reference of :mod:`tests.ops_reference` use
the same float32 IEEE operations and round-to-nearest-even, so the stored bytes agree exactly.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from dtkv import IndexerFp8Layout, MLAFp8Layout, PageOwnership
from dtkv.ops import quantize_write_indexer_fp8, quantize_write_mla_fp8
from tests.ops_reference import DEVICES, assert_same_bytes, ref_indexer_write, ref_mla_row, ref_write_rows, skip_unless

_MLA = importlib.import_module("dtkv.ops.quantize_write_mla_fp8")
_INDEXER = importlib.import_module("dtkv.ops.quantize_write_indexer_fp8")

MLA_LAYOUTS = [
    pytest.param(MLAFp8Layout(page_size=3, kv_lora_rank=96, rope_dim=6, quant_block=24), id="L96-B24-R6-ps3"),
    pytest.param(MLAFp8Layout(page_size=5, kv_lora_rank=60, rope_dim=6, quant_block=20), id="L60-B20-R6-ps5"),
    pytest.param(MLAFp8Layout(page_size=1, kv_lora_rank=20, rope_dim=2, quant_block=5), id="L20-B5-R2-ps1"),
    pytest.param(MLAFp8Layout(page_size=2, kv_lora_rank=12, rope_dim=10, quant_block=12), id="L12-B12-R10-ps2"),
    pytest.param(MLAFp8Layout(page_size=3, kv_lora_rank=12, rope_dim=0, quant_block=3), id="L12-B3-R0-ps3"),
]
INDEXER_LAYOUTS = [
    pytest.param(IndexerFp8Layout(page_size=3, head_dim=12), id="H12-ps3"),
    pytest.param(IndexerFp8Layout(page_size=5, head_dim=20), id="H20-ps5"),
    pytest.param(IndexerFp8Layout(page_size=4, head_dim=7), id="H7-ps4"),
    pytest.param(IndexerFp8Layout(page_size=4, head_dim=1), id="H1-ps4"),
    pytest.param(IndexerFp8Layout(page_size=1, head_dim=36), id="H36-ps1"),
]
DTYPES = [
    pytest.param(torch.bfloat16, id="bf16"),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.float32, id="fp32"),
]


class _LaunchSpy:
    """Stands in for a Triton kernel object: records each launch grid, then launches the real kernel."""

    def __init__(self, kernel) -> None:
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


def _forbidden(*args, **kwargs):
    raise AssertionError("backend='triton' ran the torch path")


def _rows(n: int, dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows spanning 8 decades (subnormal e4m3 codes), ties at +-0 and an all-zero row (the zero scale)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g) * 10 ** torch.empty(n, 1).uniform_(-5, 3, generator=g)
    x[n // 2] = 0.0
    x[0, 0] = -0.0
    return x.to(dtype)


def _locs(num_pages: int, page_size: int, n: int, seed: int) -> torch.Tensor:
    """``n`` distinct token locations over shuffled pages: a partial last page and ``-1`` padding."""
    g = torch.Generator().manual_seed(seed)
    pages = torch.randperm(num_pages, generator=g)
    t = torch.arange(n)
    locs = pages[t // page_size] * page_size + t % page_size
    locs[3::5] = -1
    return locs


def _pool(num_local: int, page_shape: tuple[int, ...], seed: int, device: str) -> torch.Tensor:
    """Random bytes in every other page of a buffer: the page stride is twice the page (still 4-aligned)."""
    g = torch.Generator().manual_seed(seed)
    big = torch.randint(0, 256, (2 * num_local, *page_shape), generator=g, dtype=torch.uint8)
    return big.to(device)[::2]


def _both_backends(monkeypatch, op, args, layout, start, want, module, kernel: str, torch_paths: tuple[str, ...]):
    """``op(pool, *args, layout=layout, backend=...)`` on a copy of ``start`` gives ``want``'s bytes with the torch
    backend, and with the Triton one, whose kernel must launch and whose module's torch paths must not run
    (``args[-1]`` is the rank)."""
    rank = args[-1]
    by_torch = start.clone()
    op(by_torch, *args, layout=layout, backend="torch")
    assert_same_bytes(by_torch, want, f"torch, rank {rank}")
    spy = _LaunchSpy(getattr(module, kernel))
    with monkeypatch.context() as m:
        m.setattr(module, kernel, spy)
        for name in torch_paths:
            m.setattr(module, name, _forbidden)
        pool = start.clone()
        op(pool, *args, layout=layout, backend="triton")
    assert spy.grids, "the Triton kernel did not launch"
    assert_same_bytes(pool, want, f"triton, rank {rank}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", MLA_LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_mla_quantize_write_odd_blocks_vs_reference(device, layout, dtype, monkeypatch):
    skip_unless("triton", device)
    own, ps = PageOwnership(2, 5, "interleave"), layout.page_size
    n = 5 * ps - 1 if ps > 1 else 4  # a partial last page (ps > 1) or pages left unwritten (ps == 1)
    kv = _rows(n, layout.row_dim, dtype, seed=ps)
    locs = _locs(5, ps, n, seed=ps)
    ref_rows = torch.stack([ref_mla_row(r, layout) for r in kv])
    for rank in range(2):
        start = _pool(own.num_local_pages(rank), layout.page_shape, seed=rank, device=device)
        want = ref_write_rows(start.cpu(), ref_rows, locs, own, rank)
        args = (kv.to(device), locs.to(device), own, rank)
        _both_backends(monkeypatch, quantize_write_mla_fp8, args, layout, start, want, _MLA,
                       "_quantize_write_mla_fp8_kernel", ("quantize_write_mla_fp8_torch", "quantize_mla_fp8_torch"))  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", INDEXER_LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_indexer_quantize_write_odd_head_dims_vs_reference(device, layout, dtype, monkeypatch):
    skip_unless("triton", device)
    own, ps = PageOwnership(3, 7, "block"), layout.page_size  # ranks own 3, 3 and 1 pages
    n = 6 * ps - 1 if ps > 1 else 5
    k = _rows(n, layout.head_dim, dtype, seed=layout.head_dim)
    locs = _locs(7, ps, n, seed=layout.head_dim)
    for rank in range(3):
        start = _pool(own.num_local_pages(rank), layout.page_shape, seed=rank, device=device)
        want = ref_indexer_write(start.cpu(), k, locs, own, rank, layout)
        args = (k.to(device), locs.to(device), own, rank)
        _both_backends(monkeypatch, quantize_write_indexer_fp8, args, layout, start, want, _INDEXER,
                       "_quantize_write_indexer_fp8_kernel", ("quantize_write_indexer_fp8_torch", "quantize_indexer_fp8"))  # fmt: skip
