"""``dtkv::quantize_write_mla_indexer_fp8``: a layer's new rows into both fp8 caches in one launch, byte for byte
what the two single writes store (and what the independent per-row references store), on every rank of 1-3
ranks, both backends; opcheck; errors leave both pools untouched; the decode step issues it once per layer.

Tolerances: none (stored bytes are compared exactly; both kernels run unchanged inside the fused one).
"""

from __future__ import annotations

import re

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dtkv import IndexerFp8Layout, MLAFp8Layout, PageOwnership
from dtkv.ops import quantize_write_indexer_fp8, quantize_write_mla_fp8, quantize_write_mla_indexer_fp8
from dtkv.ownership import ownership_spec
from tests.ops_reference import (
    BACKENDS,
    assert_same_bytes,
    ref_indexer_write,
    ref_mla_row,
    ref_write_rows,
    scattered_locs,
    skip_unless,
    spread_rows,
)

GEOMS = [
    pytest.param(MLAFp8Layout(page_size=16, kv_lora_rank=64, rope_dim=16, quant_block=32),
                 IndexerFp8Layout(page_size=16, head_dim=32), id="small-ps16"),
    pytest.param(MLAFp8Layout(page_size=1), IndexerFp8Layout(page_size=1, head_dim=128), id="dsv32-ps1"),
    pytest.param(MLAFp8Layout(page_size=5, kv_lora_rank=96, rope_dim=6, quant_block=32),
                 IndexerFp8Layout(page_size=5, head_dim=20), id="odd-ps5"),
]  # fmt: skip


def _pools(own, rank, kv_lay, ix_lay, gen):
    p = own.num_local_pages(rank)
    kv = torch.randint(0, 255, (p, kv_lay.page_size, kv_lay.row_bytes), dtype=torch.uint8, generator=gen)
    ix = torch.randint(0, 255, (p, *ix_lay.page_shape), dtype=torch.uint8, generator=gen)
    return kv, ix


@pytest.mark.parametrize("cp", [1, 2, 3])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kv_lay,ix_lay", GEOMS)
def test_fused_write_equals_the_two_writes_and_the_references(kv_lay, ix_lay, backend, cp):
    skip_unless(backend, "cpu")
    own, ps = PageOwnership(cp, 7, "interleave"), kv_lay.page_size
    n = 1 if ps == 1 else 3 * ps + 2  # one token / a partial last page
    g = torch.Generator().manual_seed(cp)
    kv = spread_rows(n, kv_lay.row_dim, torch.bfloat16, seed=1)
    k = spread_rows(n, ix_lay.head_dim, torch.bfloat16, seed=2, neg_zero_col=0)
    locs = scattered_locs(7, ps, n, pad_every=4 if n > 4 else 0)
    ref_rows = torch.stack([ref_mla_row(r, kv_lay) for r in kv])
    for rank in range(cp):
        kv0, ix0 = _pools(own, rank, kv_lay, ix_lay, g)
        kv_a, ix_a = kv0.clone(), ix0.clone()
        quantize_write_mla_indexer_fp8(kv_a, ix_a, kv, k, locs, own, rank, kv_layout=kv_lay, index_layout=ix_lay,
                                       backend=backend)  # fmt: skip
        kv_b, ix_b = kv0.clone(), ix0.clone()
        quantize_write_mla_fp8(kv_b, kv, locs, own, rank, layout=kv_lay, backend=backend)
        quantize_write_indexer_fp8(ix_b, k, locs, own, rank, layout=ix_lay, backend=backend)
        assert_same_bytes(kv_a, kv_b, f"kv, rank {rank}")
        assert_same_bytes(ix_a, ix_b, f"index, rank {rank}")
        assert_same_bytes(kv_a, ref_write_rows(kv0, ref_rows, locs, own, rank), f"kv vs reference, rank {rank}")
        assert_same_bytes(ix_a, ref_indexer_write(ix0, k, locs, own, rank, ix_lay), f"index vs reference, {rank}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    skip_unless(backend, "cpu")
    kv_lay, ix_lay = (
        MLAFp8Layout(page_size=4, kv_lora_rank=64, rope_dim=16, quant_block=32),
        IndexerFp8Layout(page_size=4, head_dim=32),
    )
    own = PageOwnership(2, 6)
    kv_pool, ix_pool = _pools(own, 1, kv_lay, ix_lay, torch.Generator().manual_seed(0))
    kv = spread_rows(9, kv_lay.row_dim, torch.float32)
    k = spread_rows(9, 32, torch.float32)
    locs = scattered_locs(6, 4, 9)
    args = (kv_pool, ix_pool, kv, k, locs, 2, 6, 0, 1, 64, 16, 32, 4, True, backend)
    torch.library.opcheck(torch.ops.dtkv.quantize_write_mla_indexer_fp8.default, args)


def test_rejects_bad_input_and_writes_nothing():
    kv_lay, ix_lay = (
        MLAFp8Layout(page_size=4, kv_lora_rank=64, rope_dim=16, quant_block=32),
        IndexerFp8Layout(page_size=4, head_dim=32),
    )
    own = PageOwnership(1, 3)
    kv_pool, ix_pool = _pools(own, 0, kv_lay, ix_lay, torch.Generator().manual_seed(1))
    kv0, ix0 = kv_pool.clone(), ix_pool.clone()
    kv = spread_rows(5, kv_lay.row_dim, torch.bfloat16)
    k = spread_rows(5, 32, torch.bfloat16)
    locs = torch.arange(5)

    def call(**kw):
        a = {"kv_pool": kv_pool, "index_pool": ix_pool, "kv": kv, "k": k, "locs": locs} | kw
        lays = {"kv_layout": kw.pop("kv_layout", kv_lay), "index_layout": kw.pop("index_layout", ix_lay)}
        return quantize_write_mla_indexer_fp8(**{k_: v for k_, v in a.items() if k_ not in lays}, ownership=own,
                                              rank=0, **lays, backend="torch")  # fmt: skip

    with pytest.raises(ValueError, match=re.escape("kv and k must have one row per location, got kv.shape=[5, 80]")):
        call(k=k[:4])
    with pytest.raises(ValueError, match=re.escape("kv_pool and index_pool must hold the same pages")):
        call(index_pool=ix_pool[:2])
    with pytest.raises(ValueError, match=re.escape("k must have shape [*, 32] (index_layout.head_dim)")):
        call(k=k[:, :16])
    with pytest.raises(ValueError, match="kv_layout and index_layout must share the page size, got 4 and 8"):
        call(index_layout=IndexerFp8Layout(page_size=8, head_dim=32))
    with pytest.raises(TypeError, match="kv_layout must be a dtkv.MLAFp8Layout, got IndexerFp8Layout"):
        call(kv_layout=ix_lay)
    with pytest.raises(ValueError, match=r"locs\[1\]=99"):
        call(locs=torch.tensor([0, 99, 1, 2, 3]))  # validated (eager default) before any write
    assert torch.equal(kv_pool, kv0) and torch.equal(ix_pool, ix0)


class _OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.name())
        return func(*args, **(kwargs or {}))


def test_decode_step_writes_both_rows_with_one_op():
    """``DecodeStep``'s row write of an fp8 MLA layer is one call of the fused op (one launch on a GPU)."""
    from dtkv.decode import _step_layer
    from dtkv.decode._step_layer import StepInputs

    kv_lay = MLAFp8Layout(page_size=4, kv_lora_rank=64, rope_dim=16, quant_block=32)
    ix_lay = IndexerFp8Layout(page_size=4, head_dim=32)
    own = PageOwnership(1, 3)
    kv_pool, ix_pool = _pools(own, 0, kv_lay, ix_lay, torch.Generator().manual_seed(2))

    class _Step:  # the fields write_rows reads
        fields = {"new_locs": torch.tensor([1, 6, -1])}
        ownership_spec, rank, kv_layout, index_layout, ops_backend = ownership_spec(own), 0, kv_lay, ix_lay, "torch"

    x = StepInputs(iq=None, iw=None, q=None, kv_row=spread_rows(3, kv_lay.row_dim, torch.bfloat16),
                   index_k=spread_rows(3, 32, torch.bfloat16))  # fmt: skip
    with _OpLog() as log:
        _step_layer.write_rows(_Step(), kv_pool, ix_pool, x)
    dtkv_ops = [n for n in log.names if n.startswith("dtkv::")]
    assert dtkv_ops == ["dtkv::quantize_write_mla_indexer_fp8"], log.names


def test_compiles_without_graph_breaks():
    """The public call traces into one graph (ownership as an ``OwnershipSpec``) and writes the eager bytes."""
    from torch._dynamo.testing import CompileCounterWithBackend

    kv_lay = MLAFp8Layout(page_size=4, kv_lora_rank=64, rope_dim=16, quant_block=32)
    ix_lay = IndexerFp8Layout(page_size=4, head_dim=32)
    own = PageOwnership(2, 6)
    spec = ownership_spec(own)
    kv0, ix0 = _pools(own, 1, kv_lay, ix_lay, torch.Generator().manual_seed(3))
    kv = spread_rows(9, kv_lay.row_dim, torch.bfloat16)
    k = spread_rows(9, 32, torch.bfloat16)
    locs = scattered_locs(6, 4, 9)

    def write(a, b):
        quantize_write_mla_indexer_fp8(a, b, kv, k, locs, spec, 1, kv_layout=kv_lay, index_layout=ix_lay,
                                       validate=False, backend="torch")  # fmt: skip

    cnt = CompileCounterWithBackend("eager")
    kv_c, ix_c = kv0.clone(), ix0.clone()
    torch.compile(write, backend=cnt, fullgraph=True)(kv_c, ix_c)
    kv_e, ix_e = kv0.clone(), ix0.clone()
    write(kv_e, ix_e)
    assert cnt.frame_count == 1
    assert_same_bytes(kv_c, kv_e)
    assert_same_bytes(ix_c, ix_e)
