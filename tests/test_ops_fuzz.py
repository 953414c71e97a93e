"""Property tests of every op over random index layouts: the torch and Triton backends agree byte for byte.

Each example draws a geometry (cp 1-4, 1-9 pages, either scheme, page sizes 1-8, ranks that store no pages, pools
with spare pages or padded page strides) and index tensors of int32 or int64 as plain tensors, strided slices,
columns of a matrix, transposes or expanded (broadcast) views, holding valid entries, ``-1`` sentinels, other
negatives and, in int64, locations past 2**31 and 2**32 (and ``2**63 - 1``). Empty inputs are drawn too.

- Row writes: unvalidated, both backends write exactly the reference's bytes (the rows of valid, owned locations;
  rows are a function of their location, so duplicate locations write the same bytes); validated, they raise
  with the pool untouched when the reference sees a bad row (out of range, or foreign under ``direct``) and
  write the same bytes otherwise.
- ``pack_owned_pages`` and ``pack_layer_pages``: the ops on any ``send_idx``, and the planned pack of any page list on
  every rank.
- ``remap``: any ``indices`` and ``page_map`` layouts.

Each example also draws the Triton kernels' launch configuration among ``VARIANTS`` of ``tests/test_ops_variants.py``
(tile or window owner filter, row or flat tiles, chunk plans, pages per program, the 2-byte remap map), so every
kernel variant meets the drawn index layouts.

Bitwise, no tolerance: the writes copy bytes, the fp8 writes do the same IEEE arithmetic on every backend.
CPU runs the Triton interpreter with few small examples (``deadline=None``, derandomized for CI); on CUDA the
same properties run with more examples: ``python -m pytest tests/test_ops_fuzz.py -k cuda``.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dtkv import IndexerFp8Layout, MLAFp8Layout, PageOwnership
from dtkv.ops import (
    pack_layer_pages,
    pack_layer_pages_into,
    pack_owned_pages,
    plan_pack,
    quantize_mla_fp8,
    quantize_write_indexer_fp8,
    quantize_write_mla_fp8,
    remap,
    write_owned,
)
from dtkv.ops._tuned import override
from tests.ops_reference import (
    DEVICES,
    address_check,
    assert_same_bytes,
    backend_ok,
    ref_gathered,
    ref_indexer_write,
    ref_remap,
    ref_write_rows,
)
from tests.test_ops_variants import VARIANTS

WIDE = [2**31, 2**31 + 5, 2**32, 2**32 + 5, -(2**32) + 3, -(2**31) - 1, 2**63 - 1, -(2**63)]
"""int64-only entries past int32; ``index_values`` also shifts good entries by multiples of 2**32, which narrow
(mod 2**32) back onto them."""


@pytest.fixture(autouse=True, scope="module")
def _in_bounds():
    """Under the interpreter every kernel launch here also has each active lane's address checked against its
    tensor arguments (module scope: hypothesis runs many examples per test)."""
    with address_check():
        yield


def _examples(device: str) -> int:
    return 30 if device == "cuda" else 20


def _settings(device: str):
    return settings(
        max_examples=_examples(device),
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


@contextlib.contextmanager
def _variant(ops: tuple[str, ...], pick: int) -> Iterator[None]:
    """Run the Triton kernels of ``ops`` with their configuration number ``pick`` of ``VARIANTS`` (cycling)."""
    with contextlib.ExitStack() as stack:
        for op in ops:
            stack.enter_context(override(op, **VARIANTS[op][pick % len(VARIANTS[op])]))
        yield


def _skip_unless_triton(device: str) -> None:
    if not backend_ok("triton", device):
        pytest.skip(f"Triton cannot run on {device} here (missing, or CPU without TRITON_INTERPRET=1)")


# ----------------------------------------------------------------------------------------- strategies
@st.composite
def ownerships(draw):
    """``(PageOwnership, rank, num_local)``: ``num_local`` local pages, sometimes one spare, possibly none."""
    cp = draw(st.integers(1, 4))
    own = PageOwnership(cp, draw(st.integers(1, 9)), draw(st.sampled_from(["interleave", "block"])))
    rank = draw(st.integers(0, cp - 1))
    return own, rank, own.num_local_pages(rank) + draw(st.integers(0, 1))


def index_values(draw, n: int, limit: int, dtype: torch.dtype, preferred: list[int] | None = None) -> list[int]:
    """``n`` entries of one of three mixes: ``clean`` (``preferred`` entries, e.g. the rows a rank keeps, and
    ``-1``), ``mixed`` (also any entry in ``[0, limit)`` and odd ones: other negatives, ``limit``, int32 extremes)
    and ``wild`` (also, for int64, values past 2**31 and 2**32)."""
    small = st.integers(0, limit - 1) if limit > 0 else st.just(-1)
    odd = st.sampled_from([-2, -(2**31), 2**31 - 1, limit, limit + 1])
    choices = [st.sampled_from(preferred)] * 3 if preferred else [small] * 3
    choices.append(st.just(-1))
    mix = draw(st.sampled_from(["clean", "mixed", "wild"]))
    if mix != "clean":
        choices += [small, odd]
    if mix == "wild" and dtype == torch.int64:  # extremes, and good entries shifted by multiples of 2**32
        shifted = st.builds(int.__add__, choices[0], st.sampled_from([2**32, -(2**32), 3 * 2**32, 2**40]))
        choices += [st.sampled_from(WIDE), shifted, shifted]
    return [draw(st.one_of(*choices)) for _ in range(n)]


LAYOUTS_1D = ["contiguous", "step", "column", "expanded"]


def as_layout(values: list[int], dtype: torch.dtype, layout: str, device: str) -> torch.Tensor:
    """A 1-D tensor holding ``values`` in the given memory layout (``expanded`` needs equal values)."""
    t = torch.tensor(values, dtype=dtype, device=device)
    n = t.shape[0]
    if layout == "step":  # stride 3, offset 1, valid-looking entries in between
        return torch.stack([t.roll(1), t, t.roll(2)], dim=1).flatten()[1::3]
    if layout == "column":  # a column of a [n, 2] matrix
        return torch.stack([t.roll(1), t], dim=1)[:, 1]
    if layout == "expanded":  # stride 0
        return t[:1].expand(n) if n else t
    return t


@st.composite
def locs_cases(draw, limit: int, preferred: list[int] | None = None):
    """``(values, dtype, layout)`` of a ``locs`` argument (``expanded`` repeats one value; ~1 in 13 empty)."""
    dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    layout = draw(st.sampled_from(LAYOUTS_1D))
    n = draw(st.sampled_from(range(13)))
    values = index_values(draw, n, limit, dtype, preferred)
    if layout == "expanded":
        values = values[:1] * n
    return values, dtype, layout


# ----------------------------------------------------------------------------------------- row writes
def _rows_for(values: list[int], table: torch.Tensor) -> torch.Tensor:
    """Row ``i`` is ``table[values[i] mod T]``: equal locations carry equal rows, so duplicates are well defined."""
    return table[torch.tensor([v % table.shape[0] for v in values], dtype=torch.int64)]


def _expected_outcome(values, own, rank, page_size, direct) -> tuple[list[int], bool]:
    """Reference of the row mask: the locations written (``-1`` for the skipped ones) and whether validation
    must refuse the call (a location outside ``[-1, num_pages * page_size)``, or foreign under ``direct``)."""
    limit = own.num_pages * page_size
    kept, bad = [], False
    for v in values:
        if v < -1 or v >= limit:
            bad = True
        if 0 <= v < limit and own.owner(v // page_size) == rank:
            kept.append(v)
        else:
            bad = bad or (direct and 0 <= v < limit)
            kept.append(-1)
    return kept, bad


def _check_row_write(make_pool, call, expect, bad):
    """Both backends, unvalidated: the reference's bytes. Validated: the same bytes, or a ValueError with the pool
    untouched exactly when the reference says the call is bad. Nothing outside the pool's view changes.

    ``make_pool()`` returns a fresh ``(pool, buffer)``, the pool a view of the contiguous ``buffer``."""
    pool, buf = make_pool()
    initial = buf.cpu()
    outside = torch.ones(buf.shape, dtype=torch.bool)
    outside.as_strided(pool.shape, pool.stride(), pool.storage_offset()).fill_(False)
    for backend in ("torch", "triton"):
        for validate in (False, True):
            pool, buf = make_pool()
            if validate and bad:
                with pytest.raises(ValueError, match=re.escape("locs")):
                    call(pool, backend, validate)
                assert_same_bytes(buf, initial, f"{backend}: a refused write changed the pool")
                continue
            call(pool, backend, validate)
            assert_same_bytes(pool, expect, f"{backend} validate={validate}")
            assert torch.equal(buf.cpu()[outside], initial[outside]), f"{backend} wrote outside the pool's view"


@st.composite
def row_write_cases(draw):
    own, rank, num_local = draw(ownerships())
    page_size = draw(st.sampled_from([1, 2, 3, 4, 8]))
    owned = [p * page_size + o for p in own.local_pages(rank).tolist() for o in range(page_size)]
    locs = draw(locs_cases(own.num_pages * page_size, owned))
    return own, rank, num_local, page_size, locs, draw(st.booleans()), draw(st.integers(0, 2**16))


def _fuzz_row_write(case, device, table, initial, pool_view, reference, write) -> None:
    """One example of a row write: rows ``table[loc mod T]`` at the drawn ``locs``, on a pool ``pool_view(buffer)``
    of a fresh copy of ``initial``; ``reference(start, rows, kept_locs)`` gives the expected pool."""
    own, rank, _, ps, (values, idx_dtype, layout), direct, _ = case
    src = _rows_for(values, table).to(device)
    locs = as_layout(values, idx_dtype, layout, device)
    kept, bad = _expected_outcome(values, own, rank, ps, direct)
    expect = reference(pool_view(initial).clone(), src.cpu(), torch.tensor(kept, dtype=torch.int64))

    def make_pool():
        buf = initial.to(device)
        return pool_view(buf), buf

    def call(pool, backend, validate):
        write(pool, src, locs, own, rank, direct=direct, validate=validate, backend=backend)

    _check_row_write(make_pool, call, expect, bad)


# Anchors run before the drawn examples: a strided int64 locs whose wide entries narrow onto owned locations
# (2**32 + 1 -> 1, 3 - 2**32 -> 3, 2**33 + 8 -> 8), and an int32 column of a matrix under ``direct``.
ANCHORS = [
    (PageOwnership(2, 4, "interleave"), 0, 2, 4, ([0, 9, 2**32 + 1, 8, -1, 3 - 2**32, 1, 2**33 + 8], torch.int64, "step"),
     False, 0),
    (PageOwnership(3, 7, "block"), 1, 3, 2, ([6, 7, 8, -1, 9, 10, 6], torch.int32, "column"), True, 1),
]  # fmt: skip


def _spread_table(rows: int, dim: int, g: torch.Generator) -> torch.Tensor:
    """float32 rows spanning 8 decades (fp8 subnormals, ties, saturation-free large values)."""
    return torch.randn(rows, dim, generator=g) * 10 ** torch.empty(rows, 1).uniform_(-5, 3, generator=g)


@pytest.mark.parametrize("device", DEVICES)
def test_write_owned_any_index_layout(device):
    _skip_unless_triton(device)

    @_settings(device)
    @given(case=row_write_cases(), dim=st.sampled_from([1, 3, 8]), dtype=st.sampled_from([torch.float32, torch.uint8]),
           pick=st.integers(0, 19))  # fmt: skip
    @example(case=ANCHORS[0], dim=3, dtype=torch.float32, pick=3)
    @example(case=ANCHORS[1], dim=8, dtype=torch.uint8, pick=1)
    def run(case, dim, dtype, pick):
        own, rank, num_local, ps, _, _, seed = case
        g = torch.Generator().manual_seed(seed)
        if dtype == torch.uint8:
            table = torch.randint(0, 256, (7, dim), generator=g, dtype=torch.uint8)
            initial = torch.randint(0, 256, (num_local, ps, dim), generator=g, dtype=torch.uint8)
        else:
            table, initial = torch.randn(7, dim, generator=g), torch.randn(num_local, ps, dim, generator=g)
        with _variant(("write_owned", "direct_write"), pick):
            _fuzz_row_write(case, device, table, initial, lambda buf: buf,
                            lambda start, rows, kept: ref_write_rows(start, rows, kept, own, rank), write_owned)  # fmt: skip

    run()


@pytest.mark.parametrize("device", DEVICES)
def test_quantize_write_mla_fp8_any_index_layout(device):
    _skip_unless_triton(device)

    @_settings(device)
    @given(
        case=row_write_cases(),
        dims=st.sampled_from([(8, 0, 4), (8, 2, 8), (16, 4, 4)]),
        dtype=st.sampled_from([torch.bfloat16, torch.float32]),
        page_pad=st.sampled_from([0, 4]),
        pick=st.integers(0, 19),
    )
    @example(case=ANCHORS[0], dims=(8, 2, 8), dtype=torch.bfloat16, page_pad=4, pick=0)
    @example(case=ANCHORS[1], dims=(16, 4, 4), dtype=torch.float32, page_pad=0, pick=2)
    def run(case, dims, dtype, page_pad, pick):
        own, rank, num_local, ps, _, _, seed = case
        lay = MLAFp8Layout(page_size=ps, kv_lora_rank=dims[0], rope_dim=dims[1], quant_block=dims[2])
        g = torch.Generator().manual_seed(seed)
        table = _spread_table(5, lay.row_dim, g).to(dtype)
        initial = torch.randint(0, 256, (num_local, ps * lay.row_bytes + page_pad), generator=g, dtype=torch.uint8)

        def pool_view(buf):  # the page stride is padded by page_pad bytes
            return buf[:, : ps * lay.row_bytes].view(num_local, ps, lay.row_bytes)

        def reference(start, kv, kept):
            return ref_write_rows(start, quantize_mla_fp8(kv, lay), kept, own, rank)

        with _variant(("quantize_write_mla_fp8",), pick):
            _fuzz_row_write(case, device, table, initial, pool_view, reference,
                            functools.partial(quantize_write_mla_fp8, layout=lay))  # fmt: skip

    run()


@pytest.mark.parametrize("device", DEVICES)
def test_quantize_write_indexer_fp8_any_index_layout(device):
    _skip_unless_triton(device)

    @_settings(device)
    @given(
        case=row_write_cases(),
        head_dim=st.sampled_from([4, 8, 12]),
        dtype=st.sampled_from([torch.bfloat16, torch.float32]),
        pick=st.integers(0, 19),
    )
    @example(case=ANCHORS[0], head_dim=8, dtype=torch.bfloat16, pick=0)
    @example(case=ANCHORS[1], head_dim=4, dtype=torch.float32, pick=1)
    def run(case, head_dim, dtype, pick):
        own, rank, num_local, ps, _, _, seed = case
        lay = IndexerFp8Layout(page_size=ps, head_dim=head_dim)
        g = torch.Generator().manual_seed(seed)
        table = _spread_table(5, head_dim, g).to(dtype)
        initial = torch.randint(0, 256, (num_local, *lay.page_shape), generator=g, dtype=torch.uint8)
        with _variant(("quantize_write_indexer_fp8",), pick):
            _fuzz_row_write(case, device, table, initial, lambda buf: buf,
                            lambda start, k, kept: ref_indexer_write(start, k, kept, own, rank, lay),
                            functools.partial(quantize_write_indexer_fp8, layout=lay))  # fmt: skip

    run()


# ----------------------------------------------------------------------------------------- pack
def _take_pages(pool: torch.Tensor, values: list[int]) -> torch.Tensor:
    """The pack reference: ``pool[v]`` per send row, a zero page where ``v`` is outside ``[0, P)``."""
    out = torch.zeros((len(values), *pool.shape[1:]), dtype=pool.dtype)
    for m, v in enumerate(values):
        if 0 <= v < pool.shape[0]:
            out[m] = pool[v].cpu()
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_pack_ops_any_index_layout(device):
    _skip_unless_triton(device)

    @_settings(device)
    @given(
        own_case=ownerships(),
        idx=st.data(),
        page_shape=st.sampled_from([(1, 3), (2, 4), (5,)]),
        pages=st.lists(st.integers(-1, 8), max_size=10),
        seed=st.integers(0, 2**16),
        pick=st.integers(0, 19),
    )
    def run(own_case, idx, page_shape, pages, seed, pick):
        own, rank, num_local = own_case
        g = torch.Generator().manual_seed(seed)
        pool = torch.randn(num_local, *page_shape, generator=g).to(device)
        # the op on any send list: local pages, -1, indices past the pool, wide values, any layout
        idx_dtype = idx.draw(st.sampled_from([torch.int32, torch.int64]))
        layout = idx.draw(st.sampled_from(LAYOUTS_1D))
        n = idx.draw(st.sampled_from(range(9)))
        values = index_values(idx.draw, n, num_local + 1, idx_dtype, list(range(num_local)))
        values = values[:1] * n if layout == "expanded" else values
        send = as_layout(values, idx_dtype, layout, device)
        second = torch.randint(0, 256, (3, num_local, 6), generator=g, dtype=torch.uint8).to(device)[1]  # a layer view
        expect, expect2 = _take_pages(pool, values), _take_pages(second, values)
        with _variant(("pack_owned_pages", "pack_layer_pages"), pick):
            for backend in ("torch", "triton"):
                assert_same_bytes(torch.ops.dtkv.pack_owned_pages(pool, send, backend), expect, backend)
                outs = pack_layer_pages([pool, second], send, backend=backend)
                assert_same_bytes(outs[0], expect, f"{backend} pack_layer_pages")
                assert_same_bytes(outs[1], expect2, f"{backend} pack_layer_pages")
                into = [torch.full_like(o, 7) for o in outs]
                pack_layer_pages_into(into, [pool, second], send, backend=backend)
                assert_same_bytes(into[0], expect, f"{backend} pack_layer_pages_into")
                assert_same_bytes(into[1], expect2, f"{backend} pack_layer_pages_into")
            # the planned pack of a page list on every rank (empty ranks included)
            pages = [p if p < own.num_pages else -1 for p in pages]
            full = torch.randn(own.num_pages, *page_shape, generator=g)
            plan = plan_pack(torch.tensor(pages, dtype=torch.int64, device=device), own)
            gathered, _, _, _ = ref_gathered(full, pages, own)
            for backend in ("torch", "triton"):
                bufs = [pack_owned_pages(full[own.local_pages(r)].to(device), plan, own, r, backend=backend)
                        for r in range(own.cp_size)]  # fmt: skip
                assert_same_bytes(torch.cat(bufs), gathered, f"{backend} planned")

    run()


# ----------------------------------------------------------------------------------------- remap
def as_layout_nd(values: list[int], shape: tuple[int, int], dtype, layout: str, device: str) -> torch.Tensor:
    """A ``[a, b]`` tensor of ``values`` (row-major) in a given memory layout (``expanded``: rows repeat)."""
    t = torch.tensor(values, dtype=dtype, device=device).view(shape)
    if layout == "transposed":
        return t.t().contiguous().t()
    if layout == "step":
        return torch.stack([t.roll(1), t, t.roll(2)], dim=-1).flatten(-2)[..., 1::3]
    if layout == "expanded":
        return t[:, :1].expand(shape)
    return t


@pytest.mark.parametrize("device", DEVICES)
def test_remap_any_index_layout(device):
    _skip_unless_triton(device)

    @_settings(device)
    @given(data=st.data(), page_size=st.sampled_from([1, 3, 16]), pick=st.integers(0, 19))
    def run(data, page_size, pick):
        num_map = data.draw(st.integers(1, 9))
        map_dtype = data.draw(st.sampled_from([torch.int32, torch.int64]))
        map_values = [data.draw(st.sampled_from([-1, -5]) | st.integers(0, 20)) for _ in range(num_map)]
        map_layout = data.draw(st.sampled_from(LAYOUTS_1D[:3]))
        page_map = as_layout(map_values, map_dtype, map_layout, device)
        dtype = data.draw(st.sampled_from([torch.int32, torch.int64]))
        shape = (data.draw(st.integers(0, 3)), data.draw(st.integers(1, 5)))
        layout = data.draw(st.sampled_from(["contiguous", "transposed", "step", "expanded"]))
        values = index_values(data.draw, shape[0] * shape[1], (num_map + 1) * page_size, dtype)
        indices = as_layout_nd(values, shape, dtype, layout, device)
        expect = ref_remap(indices.cpu().contiguous(), map_values, page_size)
        for backend in ("torch", "triton"):
            with _variant(("remap",), pick):
                out = remap(indices, page_map, page_size=page_size, backend=backend)
            assert out.dtype == dtype and out.shape == indices.shape and out.is_contiguous()
            assert torch.equal(out.cpu(), expect), backend

    run()
