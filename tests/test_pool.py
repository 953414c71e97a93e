"""ShardedKVPool: owned pages only, exact byte accounting, bit-exact gather, startup agreement checks."""

from __future__ import annotations

import time

import pytest
import torch
from torch.testing._internal.common_utils import TestCase

from dtkv import (
    ConfigMismatchError,
    IndexerFp8Layout,
    MLAFp8Layout,
    MLALatentLayout,
    PageOwnership,
    ShardedKVPool,
)

PAGE = 4
LAYOUTS = {
    "kv": MLALatentLayout(page_size=PAGE, kv_lora_rank=24, rope_dim=8),
    "kv8": MLAFp8Layout(page_size=PAGE, kv_lora_rank=32, rope_dim=8, quant_block=16),
    "index": IndexerFp8Layout(page_size=PAGE, head_dim=16),
}


def _reference(name: str, layer: int, num_pages: int) -> torch.Tensor:
    """The logical pool of one layer, from a generator seeded by (name, layer): identical on every rank."""
    lay = LAYOUTS[name]
    g = torch.Generator().manual_seed(1000 * layer + sorted(LAYOUTS).index(name))
    if lay.dtype == torch.uint8:
        return torch.randint(0, 256, (num_pages, *lay.page_shape), generator=g, dtype=torch.uint8)
    return torch.randn((num_pages, *lay.page_shape), generator=g).to(lay.dtype)


def _fill_and_gather(rank, world, num_pages, scheme, num_layers, page_major=False):
    import torch.distributed as dist

    own = PageOwnership(world, num_pages, scheme)
    pool = ShardedKVPool(LAYOUTS, own, num_layers=num_layers, group=dist.group.WORLD, page_major=page_major)
    mine = own.local_pages(rank)
    for name in LAYOUTS:
        for layer in range(num_layers):
            pool.local(name, layer).copy_(_reference(name, layer, num_pages)[mine])
    out = {"bytes": pool.bytes_per_rank(), "replicated": pool.replicated_bytes(), "equal": True}
    for layer in range(num_layers):
        full = pool.gather_full(layer)
        for name in LAYOUTS:
            ref = _reference(name, layer, num_pages)
            # bit for bit: compare the raw bytes (NaN-safe, dtype-agnostic)
            out["equal"] &= torch.equal(full[name].view(torch.uint8), ref.view(torch.uint8))
    # the DTensor view has the logical global shape and this rank's pages locally
    dt = pool.dtensor("kv", 0)
    out["dt_shape"] = tuple(dt.shape)
    out["dt_local_equal"] = torch.equal(dt.to_local(), pool.local("kv", 0))
    if scheme == "block":  # cross-check with the upstream placement it mirrors
        from torch.distributed.tensor import DTensor

        std = DTensor.from_local(
            pool.local("kv", 0),
            pool.mesh,
            [own.to_standard()],
            run_check=False,
            shape=dt.shape,
            stride=dt.stride(),
        )
        out["std_equal"] = torch.equal(std.full_tensor(), _reference("kv", 0, num_pages))
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("page_major", [False, True], ids=["layer_major", "page_major"])
@pytest.mark.parametrize("scheme", ["interleave", "block"])
@pytest.mark.parametrize("num_pages", [1, 7, 13])
def test_gather_full_is_bit_exact_and_bytes_are_one_cpth(ranks, num_pages, scheme, page_major):
    results = ranks.run(_fill_and_gather, num_pages, scheme, 2, page_major)
    world = len(results)
    one_page_all_layers = 2 * sum(lay.page_bytes for lay in LAYOUTS.values())
    assert sum(r["bytes"] for r in results) == results[0]["replicated"]
    for r in results:
        assert r["equal"] and r["dt_local_equal"] and r.get("std_equal", True)
        assert r["dt_shape"] == (num_pages, PAGE, 32)
        if scheme == "interleave":  # each rank holds 1/cp of the logical pool, up to one page per layer
            assert abs(r["bytes"] * world - r["replicated"]) <= world * one_page_all_layers


def _mismatched(rank, world, field):
    import torch.distributed as dist

    num_pages, layouts, scheme, num_layers, page_major = 12, dict(LAYOUTS), "interleave", 2, False
    if rank == world - 1:
        if field == "page_size":
            layouts["index"] = IndexerFp8Layout(page_size=8, head_dim=16)
        elif field == "num_pages":
            num_pages = 16
        elif field == "scheme":
            scheme = "block"
        elif field == "num_layers":
            num_layers = 3
        elif field == "page_major":
            page_major = True
    own = PageOwnership(world, num_pages, scheme)
    ShardedKVPool(layouts, own, num_layers=num_layers, group=dist.group.WORLD, page_major=page_major)


@pytest.mark.multirank
@pytest.mark.parametrize("field", ["page_size", "num_pages", "scheme", "num_layers", "page_major"])
def test_mismatched_config_raises_on_every_rank(ranks, field):
    errors = ranks.run(_mismatched, field, return_exceptions=True)
    assert all(isinstance(e, ConfigMismatchError) for e in errors), errors
    assert len({str(e) for e in errors}) == 1  # the same message everywhere
    assert field in str(errors[0])
    if field == "num_pages" and len(errors) == 2:
        assert str(errors[0]) == (
            "CP ranks disagree on the ShardedKVPool configuration: field 'num_pages' differs (rank 0: 12, rank 1: 16)"
        )


def _wrong_cp(rank, world):
    import torch.distributed as dist

    ShardedKVPool(LAYOUTS, PageOwnership(world + 1, 12), num_layers=1, group=dist.group.WORLD)


@pytest.mark.multirank
def test_cp_size_must_match_group(ranks2):
    errors = ranks2.run(_wrong_cp, return_exceptions=True)
    assert all(isinstance(e, ValueError) and "cp_size must equal the CP group size" in str(e) for e in errors)


def _one_rank_bad_argument(rank, world, kind):
    """Every rank builds the same pool except one, whose argument is bad before any collective."""
    import torch.distributed as dist

    num_layers, layouts, ownership = 2, dict(LAYOUTS), PageOwnership(world, 12)
    if rank == world - 1:
        if kind == "num_layers":
            num_layers = 0
        elif kind == "layouts":
            layouts["index"] = "indexer"
        elif kind == "ownership":
            ownership = "interleave"
    ShardedKVPool(layouts, ownership, num_layers=num_layers, group=dist.group.WORLD)


def _ready(rank, world):
    return rank


@pytest.mark.multirank
@pytest.mark.parametrize(
    "kind,error,text",
    [
        ("num_layers", ValueError, "ValueError: num_layers must be an int >= 1, got num_layers=0"),
        ("layouts", TypeError, "TypeError: layouts['index'] must be a KVLayout, got str"),
        ("ownership", TypeError, "TypeError: ownership must be a PageOwnership, got str"),
    ],
)
def test_bad_argument_on_one_rank_fails_every_rank_within_seconds(ranks, kind, error, text):
    """A rank whose arguments fail local validation used to raise before the agreement collective, leaving the
    other ranks in it until the process-group timeout; now every rank raises the same error at once."""
    ranks.run(_ready)  # spawned beforehand: the timing covers the pool constructor only
    t0 = time.perf_counter()
    errors = ranks.run(_one_rank_bad_argument, kind, return_exceptions=True)
    seconds = time.perf_counter() - t0
    world = len(errors)
    assert all(type(e) is error for e in errors), errors
    assert {str(e) for e in errors} == {f"ShardedKVPool failed on 1 of {world} ranks; rank {world - 1}: {text}"}
    assert seconds < 10, f"the ranks took {seconds:.1f} s to fail"
    assert ranks.run(_fill_and_gather, 5, "block", 1)[0]["equal"]  # the group is still usable


def _empty_rank_pool(rank, world, num_pages, scheme, page_major=False):
    import torch.distributed as dist

    from dtkv import PageAllocator

    own = PageOwnership(world, num_pages, scheme)
    pool = ShardedKVPool(LAYOUTS, own, num_layers=2, group=dist.group.WORLD, page_major=page_major)
    mine = own.local_pages(rank)
    for name in LAYOUTS:
        for layer in range(2):
            pool.local(name, layer).copy_(_reference(name, layer, num_pages)[mine])
    equal = all(
        torch.equal(
            pool.gather_full(layer, name).view(torch.uint8), _reference(name, layer, num_pages).view(torch.uint8)
        )
        for layer in range(2)
        for name in LAYOUTS
    )
    alloc = PageAllocator(own)
    balanced = alloc.alloc_balanced(num_pages)
    return {
        "num_local_pages": pool.num_local_pages,
        "shapes": {n: tuple(pool.buffer(n).shape[:2]) for n in LAYOUTS},
        "storage": {n: tuple(pool.storage(n).shape[:2]) for n in LAYOUTS},
        "bytes": pool.bytes_per_rank(),
        "equal": equal,
        "dt_shape": tuple(pool.dtensor("kv", 1).shape),
        "dt_local": tuple(pool.dtensor("kv", 1).to_local().shape),
        "balanced": sorted(balanced.tolist()),
    }


@pytest.mark.multirank
@pytest.mark.parametrize(
    "world,num_pages,scheme,empty",
    [
        (3, 4, "block", [2]),  # pages_per_rank 2: 2, 2, 0
        (4, 5, "block", [3]),  # 2, 2, 1, 0
        (4, 2, "interleave", [2, 3]),
        (2, 1, "block", [1]),
    ],
    ids=["cp3-block-4", "cp4-block-5", "cp4-interleave-2", "cp2-block-1"],
)
@pytest.mark.parametrize("page_major", [False, True], ids=["layer_major", "page_major"])
def test_ranks_that_store_no_page_are_a_normal_case(
    ranks2, ranks3, ranks4, world, num_pages, scheme, empty, page_major
):
    group = {2: ranks2, 3: ranks3, 4: ranks4}[world]
    own = PageOwnership(world, num_pages, scheme)
    assert [r for r in range(world) if own.num_local_pages(r) == 0] == empty
    results = group.run(_empty_rank_pool, num_pages, scheme, page_major)
    for r, res in enumerate(results):
        assert res["num_local_pages"] == own.num_local_pages(r)
        assert all(shape == (2, own.num_local_pages(r)) for shape in res["shapes"].values())
        stored = (own.num_local_pages(r), 2) if page_major else (2, own.num_local_pages(r))
        assert all(shape == stored for shape in res["storage"].values())
        assert res["equal"] and res["dt_shape"] == (num_pages, PAGE, 32)
        assert res["dt_local"] == (own.num_local_pages(r), PAGE, 32)
        assert res["balanced"] == list(range(num_pages))
        if r in empty:
            assert res["bytes"] == 0
    assert (
        sum(res["bytes"] for res in results)
        == ShardedKVPool(LAYOUTS, PageOwnership(1, num_pages), num_layers=2).bytes_per_rank()
    )


def _bad_gather(rank, world):
    import torch.distributed as dist

    from dtkv.pool import gather_pages

    own = PageOwnership(world, 6)
    local = torch.zeros(own.num_local_pages(rank) + (rank == 0), 3)  # rank 0 passes one page too many
    gather_pages(local, own, dist.group.WORLD)


@pytest.mark.multirank
def test_gather_pages_with_a_bad_local_pool_fails_every_rank(ranks2):
    errors = ranks2.run(_bad_gather, return_exceptions=True)
    assert all(type(e) is ValueError for e in errors), errors
    assert {str(e) for e in errors} == {
        "gather_pages failed on 1 of 2 ranks; rank 0: ValueError: local must hold rank 0's 3 pages in dim 0 "
        "(ownership PageOwnership(cp_size=2, num_pages=6, scheme='interleave')), got local.shape=[4, 3]"
    }


def test_single_process_pool_views_and_sizes():
    pool = ShardedKVPool(LAYOUTS, PageOwnership(1, 5), num_layers=3)
    assert pool.buffer("index").shape == (3, 5, PAGE * 20)
    assert pool.local("kv8", 2).shape == (5, PAGE, 32 + 4 * 2 + 16)
    assert pool.local("kv", 1).data_ptr() == pool.buffer("kv")[1].data_ptr()
    assert pool.bytes_per_rank() == pool.replicated_bytes() == 3 * 5 * sum(lay.page_bytes for lay in LAYOUTS.values())
    assert IndexerFp8Layout().page_bytes == 8448 and MLAFp8Layout().row_bytes == 656


@pytest.mark.parametrize("num_layers,num_pages", [(1, 5), (3, 7), (4, 1)])
def test_page_major_pool_stores_a_pages_layers_next_to_each_other(num_layers, num_pages):
    lm = ShardedKVPool(LAYOUTS, PageOwnership(1, num_pages), num_layers=num_layers)
    pm = ShardedKVPool(LAYOUTS, PageOwnership(1, num_pages), num_layers=num_layers, page_major=True)
    assert not lm.describe()["page_major"] and pm.describe()["page_major"]
    assert pm.bytes_per_rank() == lm.bytes_per_rank() == pm.replicated_bytes()
    g = torch.Generator().manual_seed(num_layers)
    for name, lay in LAYOUTS.items():
        assert pm.storage(name).shape == (num_pages, num_layers, *lay.page_shape) and pm.storage(name).is_contiguous()
        assert lm.storage(name).shape == (num_layers, num_pages, *lay.page_shape) and lm.storage(name).is_contiguous()
        assert pm.buffer(name).shape == lm.buffer(name).shape == (num_layers, num_pages, *lay.page_shape)
        assert pm.buffer(name).data_ptr() == pm.storage(name).data_ptr()
        raw = torch.randint(0, 256, lm.buffer(name).view(torch.uint8).shape, generator=g, dtype=torch.uint8)
        for layer in range(num_layers):  # written through the per-layer views, as the ops write
            pm.local(name, layer).view(torch.uint8).copy_(raw[layer])
            lm.local(name, layer).view(torch.uint8).copy_(raw[layer])
        assert torch.equal(pm.buffer(name).view(torch.uint8), lm.buffer(name).view(torch.uint8))
        page_bytes, elems = lay.page_bytes, lay.page_bytes // lay.dtype.itemsize
        flat = pm.storage(name).view(torch.uint8).reshape(-1)
        for layer in range(num_layers):
            local = pm.local(name, layer)
            assert local.stride(0) == num_layers * elems and local[0].is_contiguous()
            for j in range(num_pages):  # (layer l, page j) at byte (j * num_layers + l) * page_bytes of the storage
                start = (j * num_layers + layer) * page_bytes
                assert torch.equal(flat[start : start + page_bytes], raw[layer, j].reshape(-1))
    assert "page_major=True" in repr(pm) and "page_major" not in repr(lm)


def test_page_major_must_be_a_bool():
    with pytest.raises(TypeError, match=r"page_major must be a bool, got page_major=1"):
        ShardedKVPool(LAYOUTS, PageOwnership(1, 5), num_layers=2, page_major=1)


class TestPoolErrors(TestCase):
    def test_error_text(self):
        pool = ShardedKVPool(LAYOUTS, PageOwnership(1, 5), num_layers=2)
        with self.assertRaises(KeyError) as e:
            pool.local("v", 0)
        self.assertExpectedInline(str(e.exception), """"name must be one of ['index', 'kv', 'kv8'], got name='v'\"""")
        with self.assertRaises(IndexError) as e:
            pool.local("kv", 2)
        self.assertExpectedInline(str(e.exception), """layer must be an int in [0, 2), got layer=2""")
        with self.assertRaises(ValueError) as e:
            ShardedKVPool(
                {"a": MLALatentLayout(page_size=4), "b": IndexerFp8Layout(page_size=8)},
                PageOwnership(1, 5),
                num_layers=1,
            )
        self.assertExpectedInline(str(e.exception), """layouts must share one page_size, got [4, 8]""")
        with self.assertRaises(ValueError) as e:
            MLAFp8Layout(kv_lora_rank=100, quant_block=64)
        self.assertExpectedInline(
            str(e.exception),
            """kv_lora_rank must be divisible by quant_block, got kv_lora_rank=100, quant_block=64""",
        )
        with self.assertRaises(ValueError) as e:
            ShardedKVPool(LAYOUTS, PageOwnership(2, 5), num_layers=1)
        self.assertExpectedInline(
            str(e.exception),
            """ownership.cp_size must equal the CP group size, got cp_size=2, group size=1""",
        )
