"""The ops on DTensor pools (``register_sharding``), on a 2-rank gloo group, against single-process references.

Each rank builds the same global inputs from a seed, wraps its local pool as a DTensor with the
:class:`dtkv.PageOwnership` placement, calls the op, and compares its local result (or a ``full_tensor()``) with the
references of :mod:`tests.ops_reference`. Bitwise: nothing here converts values except the fp8 ops, whose bytes
are deterministic (see their own tests).
"""

from __future__ import annotations

import pytest
import torch

from dtkv import IndexerFp8Layout, MLAFp8Layout, PageOwnership

pytestmark = pytest.mark.multirank


def _pool_dtensor(local: torch.Tensor, own: PageOwnership):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (own.cp_size,))
    shape = (own.num_pages, *local.shape[1:])
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, [own], run_check=False, shape=shape, stride=stride)


def _write_worker(rank: int, world: int) -> dict[str, bool]:
    from dtkv.ops import direct_write, quantize_write_indexer_fp8, quantize_write_mla_fp8, write_owned
    from tests.ops_reference import ref_indexer_write, ref_mla_row, ref_write_rows, scattered_locs

    own, ps, dim = PageOwnership(world, 7, "interleave"), 4, 6
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(25, dim, generator=g)
    locs = scattered_locs(7, ps, 25)
    res = {}

    local = torch.zeros(own.num_local_pages(rank), ps, dim)
    write_owned(_pool_dtensor(local, own), rows, locs, own, rank=0, backend="torch")  # rank comes from the mesh
    res["write_owned"] = torch.equal(local, ref_write_rows(torch.zeros_like(local), rows, locs, own, rank))

    mine = own.owner(torch.div(locs, ps, rounding_mode="floor")) == rank
    local = torch.zeros(own.num_local_pages(rank), ps, dim)
    direct_write(_pool_dtensor(local, own), rows[mine], locs[mine], own, rank, backend="torch")
    res["direct_write"] = torch.equal(local, ref_write_rows(torch.zeros_like(local), rows, locs, own, rank))

    lay = MLAFp8Layout(page_size=ps, kv_lora_rank=64, rope_dim=16, quant_block=32)
    kv = torch.randn(25, lay.row_dim, generator=g)
    local = torch.zeros(own.num_local_pages(rank), ps, lay.row_bytes, dtype=torch.uint8)
    quantize_write_mla_fp8(_pool_dtensor(local, own), kv, locs, own, rank, layout=lay, backend="torch")
    ref_rows = torch.stack([ref_mla_row(r, lay) for r in kv])
    res["quantize_write_mla_fp8"] = torch.equal(
        local, ref_write_rows(torch.zeros_like(local), ref_rows, locs, own, rank)
    )

    ilay = IndexerFp8Layout(page_size=ps, head_dim=32)
    k = torch.randn(25, 32, generator=g)
    local = torch.zeros(own.num_local_pages(rank), *ilay.page_shape, dtype=torch.uint8)
    quantize_write_indexer_fp8(_pool_dtensor(local, own), k[mine], locs[mine], own, rank, layout=ilay,
                               direct=True, backend="torch")  # fmt: skip
    res["quantize_write_indexer_fp8"] = torch.equal(
        local, ref_indexer_write(torch.zeros_like(local), k, locs, own, rank, ilay)
    )
    return res


def _pack_worker(rank: int, world: int) -> dict[str, bool]:
    from torch.distributed.tensor import DTensor, Replicate

    from dtkv.ops import pack_owned_pages, plan_pack, remap
    from tests.ops_reference import ref_gathered, ref_remap

    own = PageOwnership(world, 9, "block")
    full = torch.randn(9, 3, 5, generator=torch.Generator().manual_seed(1))
    pages = [8, 0, 4, -1, 5, 1]
    plan = plan_pack(torch.tensor(pages), own)
    local = full[own.local_pages(rank)].clone()
    pool = _pool_dtensor(local, own)
    out = pack_owned_pages(pool, plan, own, rank, backend="torch")
    expect, _, page_map, _ = ref_gathered(full, pages, own)
    res = {
        "pack_is_shard0": isinstance(out, DTensor) and out.placements[0].is_shard(0),
        "pack_full_tensor": torch.equal(out.full_tensor(), expect),
        "pack_local": torch.equal(out.to_local(), pack_owned_pages(local, plan, own, rank, backend="torch")),
    }
    topk = torch.tensor([[0, 5, 26], [13, -1, 17]])
    mesh = pool.device_mesh
    out = remap(DTensor.from_local(topk, mesh, [Replicate()], run_check=False),
                DTensor.from_local(plan.page_map, mesh, [Replicate()], run_check=False), page_size=3)  # fmt: skip
    res["remap_replicate"] = torch.equal(out.to_local(), ref_remap(topk, page_map, 3))
    return res


def test_write_ops_on_dtensor_pools(ranks2):
    for rank, res in enumerate(ranks2.run(_write_worker)):
        assert all(res.values()), f"rank {rank}: {res}"


def test_pack_and_remap_on_dtensors(ranks2):
    for rank, res in enumerate(ranks2.run(_pack_worker)):
        assert all(res.values()), f"rank {rank}: {res}"


def test_rejects_pool_with_other_placement(ranks2):
    results = ranks2.run(_wrong_placement_worker, return_exceptions=True)
    for res in results:
        assert isinstance(res, ValueError) and "pool DTensor must have placements" in str(res), res


def _wrong_placement_worker(rank: int, world: int):
    from dtkv.ops import write_owned

    own = PageOwnership(world, 4, "interleave")
    pool = _pool_dtensor(torch.zeros(2, 2, 3), PageOwnership(world, 4, "block"))
    write_owned(pool, torch.zeros(1, 3), torch.tensor([0]), own, rank)
