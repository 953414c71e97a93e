"""The copy-engine backend's data movement and ordering rules, on gloo ranks with a file-backed stand-in for
``torch.distributed._symmetric_memory`` (each rank's buffer is a shared ``mmap`` the peers map too, a barrier is
a gloo barrier): views hold the owners' bytes on 2, 3 and 4 ranks in every plan shape, scratch is exactly the two
views, ``replan`` reuses the buffers, released buffers are reused only when every rank released them, and the
extra barrier runs exactly when one view parity is written twice in a row. The ranks run concurrently, so a
missing barrier lets a rank overwrite rows a peer is still reading."""

from __future__ import annotations

import gc
import math
import os

import pytest
import torch

from dtkv import PageOwnership, ShardedKVPool
from dtkv.materialize import MaterializeError, plan_materialize
from tests.test_materialize import CASES, LAYOUTS, NUM_LAYERS, _fill


@pytest.fixture(params=[2, 3, 4], ids=["world2", "world3", "world4"])
def world_ranks(request, ranks2, ranks3, ranks4):
    return {2: ranks2, 3: ranks3, 4: ranks4}[request.param]


# ------------------------------------------------------------------------------------------- the stand-in
class _FakeHandle:
    def __init__(self, paths: list[str], nbytes: int, group) -> None:
        self._paths, self._nbytes, self._group = paths, nbytes, group
        self._maps: dict[int, torch.Tensor] = {}

    def _map(self, rank: int) -> torch.Tensor:
        if rank not in self._maps:
            self._maps[rank] = torch.from_file(self._paths[rank], shared=True, size=self._nbytes, dtype=torch.uint8)
        return self._maps[rank]

    def get_buffer(self, rank, sizes, dtype, storage_offset=0):
        n, item = math.prod(sizes), dtype.itemsize
        return self._map(rank)[storage_offset * item : (storage_offset + n) * item].view(dtype).view(tuple(sizes))

    def barrier(self, channel=0, timeout_ms=0):
        import torch.distributed as dist

        dist.barrier(self._group)


class FakeSymmMem:
    """``empty`` / ``rendezvous`` over files in ``root`` (what :func:`dtkv.materialize._symm.symm_mem_module` returns)."""

    def __init__(self, root: str, rank: int) -> None:
        self.root, self.rank, self.count = root, rank, 0
        os.makedirs(root, exist_ok=True)
        self.paths: dict[int, tuple[str, int]] = {}

    def empty(self, n, dtype, device):
        path = os.path.join(self.root, f"rank{self.rank}_{self.count}")
        self.count += 1
        t = torch.from_file(path, shared=True, size=n, dtype=torch.uint8)
        self.paths[t.data_ptr()] = (path, n)
        return t

    def rendezvous(self, tensor, group_name):
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _resolve_process_group

        group = _resolve_process_group(group_name)
        path, n = self.paths[tensor.data_ptr()]
        paths: list[str | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(paths, path, group=group)
        return _FakeHandle(paths, n, group)


class _patched:
    """Inside a rank: the copy engines usable on CPU through :class:`FakeSymmMem`, a fresh buffer registry."""

    def __init__(self, root: str, rank: int) -> None:
        self.fake = FakeSymmMem(root, rank)

    def __enter__(self):
        from dtkv.materialize import _gather, _symm

        self._saved = (_symm.symm_mem_module, _gather.copy_engine_usable, dict(_symm.SymmBuffers._cache))
        _symm.symm_mem_module = lambda: self.fake
        _gather.copy_engine_usable = lambda group, device: True
        _symm.SymmBuffers._cache.clear()
        return self.fake

    def __exit__(self, *exc):
        from dtkv.materialize import _gather, _symm

        _symm.symm_mem_module, _gather.copy_engine_usable, cache = self._saved
        _symm.SymmBuffers._cache.clear()
        _symm.SymmBuffers._cache.update(cache)
        return False


def _registry():
    import torch.distributed as dist

    from dtkv.materialize._symm import SymmBuffers

    return SymmBuffers.get(dist.group.WORLD, torch.device("cpu"))


def _check(mat, ref, plan, layers, prefetch: bool) -> list[bool]:
    """View ``layers`` in order (prefetching the next one when asked) and compare every mapped row."""
    rows, ok = plan.page_map[plan.pages].long(), []
    if prefetch and layers:
        mat.prefetch(layers[0])
    for i, layer in enumerate(layers):
        if prefetch and i + 1 < len(layers):
            mat.prefetch(layers[i + 1])
        views = mat.view(layer)
        for name in LAYOUTS:
            want = ref[name][layer, plan.pages].view(torch.uint8)
            ok.append(torch.equal(views[name][rows].view(torch.uint8), want))
    return ok


# ------------------------------------------------------------------------------------------- every plan shape
def _views(rank, world, root, case, pack):
    import torch.distributed as dist

    import dtkv
    from dtkv.materialize import Materializer

    with _patched(root, rank):
        scheme, num_pages, hist_fn, cur_fn, write_current = CASES[case]
        own = PageOwnership(world, num_pages(world), scheme)
        pool = ShardedKVPool(LAYOUTS, own, num_layers=NUM_LAYERS, group=dist.group.WORLD)
        g = torch.Generator().manual_seed(3)
        plan = plan_materialize(hist_fn(world, g), cur_fn(world, g), own, rank, group=dist.group.WORLD,
                                write_current=write_current)  # fmt: skip
        view_bytes = 2 * plan.num_view_pages * sum(lay.page_bytes for lay in LAYOUTS.values())
        out = {"ok": [], "scratch": [], "view_bytes": view_bytes}
        for prefetch in (False, True):
            mat = Materializer(pool, plan, backend="copy_engine", pack=pack)
            out["backend"] = mat.backend
            out["scratch"].append(mat.scratch_bytes())
            for seed in (5, 6):  # a second fill: the next gathers reuse the same rows
                ref = _fill(pool, own, rank, seed)
                with dtkv.debug_mode():  # the synchronizing check runs inside view() too
                    out["ok"] += _check(mat, ref, plan, list(range(NUM_LAYERS)), prefetch)
            del mat
        return out


@pytest.mark.multirank
@pytest.mark.parametrize("case", sorted(CASES))
def test_copy_engine_views_hold_the_owners_bytes_and_scratch_is_two_views(world_ranks, case, tmp_path):
    for res in world_ranks.run(_views, str(tmp_path), case, "torch"):
        assert res["backend"] == "copy_engine"
        assert res["ok"] and all(res["ok"]), res
        assert res["scratch"] == [res["view_bytes"]] * 2  # no send slot: the views are the symmetric buffer


@pytest.mark.multirank
@pytest.mark.parametrize("case", ["random", "empty-rank-block"])
def test_copy_engine_with_the_triton_pack(ranks2, case, tmp_path):
    """Pages out of send order are packed straight into this rank's rows of its view (one interpreted launch)."""
    for res in ranks2.run(_views, str(tmp_path), case, "triton"):
        assert all(res["ok"]), res


# ------------------------------------------------------------------------------------------- replan, reuse
def _plans(own, rank, world):
    """Plans of different shapes: growing history, a shuffled one with a current group, then one past capacity."""
    import torch.distributed as dist

    g = torch.Generator().manual_seed(9)
    n = own.num_pages
    shapes = [
        (torch.arange(10), torch.arange(10, 12), True),
        (torch.arange(14), torch.arange(14, 16), True),
        (torch.randperm(n, generator=g)[:12], torch.tensor([n - 1, 1]), False),
        (torch.arange(n - 3), torch.arange(n - 3, n), False),  # past max_view_pages: the buffers grow
    ]
    return [plan_materialize(h, c, own, rank, group=dist.group.WORLD, write_current=w) for h, c, w in shapes]


def _replan(rank, world, root, backend):
    import torch.distributed as dist

    from dtkv.materialize import Materializer

    with _patched(root, rank):
        own = PageOwnership(world, 31, "interleave")
        pool = ShardedKVPool(LAYOUTS, own, num_layers=NUM_LAYERS, group=dist.group.WORLD)
        plans = _plans(own, rank, world)
        cap = max(p.num_view_pages for p in plans[:3]) + 1
        mat = Materializer(pool, plans[0], backend=backend, max_view_pages=cap)
        first_capacity, allocs, ok = mat.capacity_pages, [], []
        for i, plan in enumerate(plans):
            if i:
                mat.replan(plan)
            allocs.append(_registry().next_id if backend == "copy_engine" else None)
            for seed in (i, i + 10):
                ref = _fill(pool, own, rank, seed)
                ok += _check(mat, ref, plan, list(range(NUM_LAYERS)), prefetch=bool(i % 2))
        pending = None
        mat.prefetch(0)
        try:
            mat.replan(plans[0])
        except RuntimeError as e:
            pending = str(e)
        mat.view(0)
        return {"ok": ok, "allocs": allocs, "capacity": [first_capacity, mat.capacity_pages],
                "sizes": [p.num_view_pages for p in plans], "pending": pending}  # fmt: skip


@pytest.mark.multirank
@pytest.mark.parametrize("backend", ["copy_engine", "all_gather"])
def test_replan_serves_every_plan_and_grows_only_past_capacity(ranks2, ranks3, backend, tmp_path):
    for ranks in (ranks2, ranks3):
        for res in ranks.run(_replan, str(tmp_path / str(ranks.world_size)), backend):
            assert all(res["ok"]), res
            sizes = res["sizes"]
            assert res["capacity"] == [max(sizes[:3]) + 1, sizes[3]] and sizes[3] > max(sizes[:3]) + 1
            if backend == "copy_engine":
                assert res["allocs"] == [1, 1, 1, 2]  # one symmetric allocation, then one when the plan outgrew it
            assert res["pending"] == "replan() needs no gather in flight, got layers [0] pending"


def _interleaved(rank, world, root, release_on):
    import torch.distributed as dist

    from dtkv.materialize import Materializer

    with _patched(root, rank):
        own = PageOwnership(world, 29, "interleave")
        pool_a = ShardedKVPool(LAYOUTS, own, num_layers=NUM_LAYERS, group=dist.group.WORLD)
        pool_b = ShardedKVPool(LAYOUTS, own, num_layers=NUM_LAYERS, group=dist.group.WORLD)
        plan = plan_materialize(torch.arange(20), torch.arange(20, 23), own, rank, group=dist.group.WORLD)
        a = Materializer(pool_a, plan, backend="copy_engine")
        b = Materializer(pool_b, plan, backend="copy_engine")
        ref_a, ref_b = _fill(pool_a, own, rank, 1), _fill(pool_b, own, rank, 2)
        ok = []
        a.prefetch(0)
        b.prefetch(0)
        for layer in range(NUM_LAYERS):  # the two Materializers' gathers alternate on the shared streams
            for mat, ref in ((a, ref_a), (b, ref_b)):
                mat.prefetch(layer + 1)
                ok += _check(mat, ref, plan, [layer], prefetch=False)
        ids = {"a": a._impl.buf.id, "b": b._impl.buf.id}
        if rank in release_on:
            del a
            gc.collect()
        c = Materializer(pool_a, plan, backend="copy_engine")
        ids["c"] = c._impl.buf.id
        ok += _check(c, _fill(pool_a, own, rank, 3), plan, list(range(NUM_LAYERS)), prefetch=True)
        return {"ok": ok, "ids": ids}


@pytest.mark.multirank
def test_two_materializers_interleave_and_a_buffer_is_reused_only_once_every_rank_released_it(ranks3, tmp_path):
    for res in ranks3.run(_interleaved, str(tmp_path / "all"), [0, 1, 2]):
        assert all(res["ok"]), res
        assert res["ids"] == {"a": 0, "b": 1, "c": 0}  # a's buffer, released everywhere, serves c
    for res in ranks3.run(_interleaved, str(tmp_path / "one"), [0]):
        assert all(res["ok"]), res
        assert res["ids"] == {"a": 0, "b": 1, "c": 2}  # released on rank 0 only: a new buffer on every rank


def _barriers(rank, world, root, num_layers):
    import torch.distributed as dist

    from dtkv.materialize import Materializer

    with _patched(root, rank):
        own = PageOwnership(world, 24, "interleave")
        pool = ShardedKVPool(LAYOUTS, own, num_layers=num_layers, group=dist.group.WORLD)
        plan = plan_materialize(torch.arange(20), [], own, rank, group=dist.group.WORLD)
        mat = Materializer(pool, plan, backend="copy_engine")
        counts = []
        for _ in range(2):  # two passes over every layer: the wrap from the last layer to layer 0
            before = _registry().barriers
            for layer in range(num_layers):
                mat.view(layer)
            counts.append(_registry().barriers - before)
        mat.replan(plan)
        before = _registry().barriers
        mat.view(0)
        counts.append(_registry().barriers - before)
        return counts


@pytest.mark.multirank
@pytest.mark.parametrize(
    "num_layers,want",
    [
        (1, [2, 2, 2]),  # one parity only: every gather after the first repeats it
        (2, [3, 2, 2]),  # the fence once, then parities alternate, also across the wrap
        (3, [4, 4, 2]),  # layer 2 -> layer 0 repeats parity 0: one extra barrier per pass
    ],
)
def test_an_extra_barrier_runs_exactly_when_a_parity_repeats_and_after_replan(ranks2, num_layers, want, tmp_path):
    for counts in ranks2.run(_barriers, str(tmp_path), num_layers):
        assert counts == want


def _capacity_mismatch(rank, world, root):
    import torch.distributed as dist

    from dtkv.materialize import Materializer

    with _patched(root, rank):
        own = PageOwnership(world, 16, "interleave")
        pool = ShardedKVPool(LAYOUTS, own, num_layers=1, group=dist.group.WORLD)
        plan = plan_materialize(torch.arange(8), [], own, rank, group=dist.group.WORLD)
        try:
            Materializer(pool, plan, backend="copy_engine", max_view_pages=8 + rank)
        except MaterializeError as e:
            return str(e)
        return None


@pytest.mark.multirank
def test_ranks_asking_for_different_capacities_fail_together(ranks2, tmp_path):
    messages = ranks2.run(_capacity_mismatch, str(tmp_path))
    assert len(set(messages)) == 1 and messages[0] is not None
    assert messages[0].startswith("CP ranks asked for copy-engine view buffers of different sizes (rank 0: ")


def test_max_view_pages_is_checked():
    from dtkv.materialize import Materializer

    own = PageOwnership(1, 9)
    pool = ShardedKVPool(LAYOUTS, own, num_layers=1)
    plan = plan_materialize([1, 2], [3], own, 0)
    for bad in (-1, True, 2.5):
        with pytest.raises(ValueError, match="max_view_pages must be an int >= 0 or None, got max_view_pages="):
            Materializer(pool, plan, max_view_pages=bad)
    mat = Materializer(pool, plan, max_view_pages=1)
    assert mat.capacity_pages == plan.num_view_pages
    with pytest.raises(ValueError, match="plan was built for"):
        mat.replan(plan_materialize([1], [], PageOwnership(2, 9), 0))


def _bench_check(rank, world, root):
    from tests.test_bench_runtime import _load

    with _patched(root, rank):
        return _load("bench_materialize").check(rank, world, torch.device("cpu"), ["copy_engine"])


@pytest.mark.multirank
def test_bench_materialize_check_passes_on_the_copy_engine_path(ranks2, tmp_path):
    """``bench_materialize.py --check``'s cases (every plan shape, replan with growth, two interleaved
    Materializers) through the copy-engine path: what the GPU run checks, minus streams and graphs."""
    assert ranks2.run(_bench_check, str(tmp_path)) == [True, True]


def test_plans_reach_a_cuda_device_from_pinned_memory_without_blocking(monkeypatch):
    """A pageable host-to-device copy waits for every kernel queued on the stream; the plan's copies must not."""
    from dtkv.materialize import _plan

    calls = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: calls.append("pin") or self)
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: calls.append(("to", a, k)) or self)
    t = torch.arange(3)
    _plan._to_device(t, torch.device("cuda", 0))
    assert calls == ["pin", ("to", (torch.device("cuda", 0),), {"non_blocking": True})]
    calls.clear()
    _plan._to_device(t, torch.device("cpu"))
    assert calls == [("to", (torch.device("cpu"),), {})]
