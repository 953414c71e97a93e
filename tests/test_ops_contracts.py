"""Contracts every ``dtkv::`` op keeps, written once and driven by a table of ops.

- ``opcheck``: schema, fake, autograd registration and AOT dispatch agree with the real op, on every backend.
- fullgraph compile: the public call traces into one graph with no graph break and gives the eager bytes.
- reject-and-unchanged: bad input raises the pinned error and leaves the pool byte-identical, on every backend.
- index arguments: any strides (slices, transposed views) give the bytes of the contiguous tensor on every backend;
  row writes skip int64 locations past 2**31 and 2**32 unvalidated and refuse them validated (pool untouched), in
  both the int32 and the int64 arithmetic of the kernels.

Each op's own test file keeps its reference comparisons. No tolerances: outputs are compared byte for byte.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from dtkv import IndexerFp8Layout, MLAFp8Layout, PageOwnership
from dtkv.ops import (
    dequantize_indexer_pages,
    dequantize_mla_fp8,
    direct_write,
    pack_layer_pages,
    pack_owned_pages,
    plan_pack,
    quantize_write_indexer_fp8,
    quantize_write_mla_fp8,
    remap,
    write_owned,
)
from tests.ops_reference import (
    BACKENDS,
    OWNERSHIP_KINDS,
    as_kind,
    assert_same_bytes,
    backend_ok,
    layer_pools,
    scattered_locs,
    skip_unless,
    spread_rows,
)

MLA = MLAFp8Layout(page_size=16, kv_lora_rank=64, rope_dim=16, quant_block=32)
IDX = IndexerFp8Layout(page_size=16, head_dim=32)


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _triton_or_torch() -> str:
    return "triton" if backend_ok("triton", "cpu") else "torch"


# ----------------------------------------------------------------------------------------- the table
@dataclass(frozen=True)
class OpCase:
    """One op: a sample call of the registered op, a compiled step, and the bad inputs it must refuse."""

    name: str
    op: Any
    """The registered overload (``torch.ops.dtkv.<op>.default``)."""
    sample: Callable[[str], tuple]
    """Backend -> positional arguments of the registered op (for ``opcheck``)."""
    step: Callable[[str, Any], Callable[..., Any]] | None = None
    """``(backend, ownership) -> fn(*inputs)``: the public call(s) to compile; ``ownership`` is None if unused."""
    inputs: Callable[[], tuple] | None = None
    """Fresh inputs of ``step`` (called once for eager, once for compiled)."""
    uses_ownership: bool = True
    base: Callable[[], dict[str, Any]] | None = None
    """Arguments of a good public call; each bad case overrides some of them."""
    call: Callable[[dict[str, Any], str], None] | None = None
    """``(args, backend)``: the public call of a reject case."""
    bad: list[tuple[str, dict[str, Any], type, str]] = field(default_factory=list)
    """``(what, change, exception, message)`` of each input it must refuse with the pool untouched."""
    with_index: Callable[[str, Callable[[torch.Tensor], torch.Tensor]], tuple] | None = None
    """``(backend, view) -> outputs`` of a fixed call whose index arguments all go through ``view`` first."""
    new_pool: Callable[[bool], torch.Tensor] | None = None
    """Row writes: ``wide -> pool``; ``wide`` picks 2**32 logical locations (64-bit kernel arithmetic) instead of
    a small pool (32-bit arithmetic)."""
    write_at: Callable[[torch.Tensor, torch.Tensor, str, bool, bool], None] | None = None
    """Row writes: ``(pool, locs, backend, validate, wide)`` writes fixed rows at ``locs``."""


def _write_owned_step(backend, own):
    def step(pool, rows, locs):
        write_owned(pool, rows, locs, own, 1, backend=backend)
        return pool.sum()

    return step


def _mla_step(backend, own):
    def step(pool, kv, locs):
        quantize_write_mla_fp8(pool, kv, locs, own, 1, layout=MLA, backend=backend)
        return dequantize_mla_fp8(pool, MLA)

    return step


def _indexer_step(backend, own):
    def step(pool, k, locs):
        quantize_write_indexer_fp8(pool, k, locs, own, 0, layout=IDX, backend=backend)
        return dequantize_indexer_pages(pool, IDX)

    return step


def _pack_step(backend, own):
    """The run (pack + remap of a top-k tensor against the plan) is one graph; the plan stays outside."""
    plan = plan_pack(torch.tensor([6, 1, 3, 4]), own)

    def step(pool, topk):
        return pack_owned_pages(pool, plan, own, 0, backend=backend), remap(topk, plan.page_map, page_size=4)

    return step


def _pack_layer_step(backend, own):
    def step(a, b, idx):
        return tuple(pack_layer_pages([a, b], idx, backend=backend))

    return step


def _remap_step(backend, own):
    page_map = torch.tensor([1, -1, 0], dtype=torch.int32)

    def step(topk):
        return remap(topk, page_map, page_size=16, backend=backend) + 0

    return step


def _write_owned_call(a, backend):
    write_owned(a["pool"], a["rows"], a["locs"], a["own"], a["rank"], backend=backend)


def _direct_write_call(a, backend):
    rows = torch.randn(a["locs"].shape[0], a["pool"].shape[2])
    direct_write(a["pool"], rows, a["locs"], a["own"], 0, backend=backend)


def _mla_call(a, backend):
    quantize_write_mla_fp8(a["pool"], a["kv"], a["locs"], a["own"], 0, layout=MLA, direct=a["direct"], backend=backend)


def _indexer_call(a, backend):
    quantize_write_indexer_fp8(a["pool"], a["k"], a["locs"], a["own"], 0, layout=IDX, direct=a["direct"],
                               backend=backend)  # fmt: skip


# ----------------------------------------------------------------------------------------- index calls
def _index_write_owned(backend, view):
    own, pool = PageOwnership(2, 6, "interleave"), torch.zeros(3, 4, 8)
    write_owned(pool, torch.randn(10, 8, generator=_gen()), view(scattered_locs(6, 4, 10)), own, 1, backend=backend)
    return (pool,)


def _index_direct_write(backend, view):
    own, pool = PageOwnership(2, 6, "interleave"), torch.zeros(3, 4, 8)
    t = torch.arange(10)
    locs = own.local_pages(0)[t // 4] * 4 + t % 4  # rank 0's pages 0 2 4
    direct_write(pool, torch.randn(10, 8, generator=_gen()), view(locs), own, 0, backend=backend)
    return (pool,)


def _index_mla(backend, view):
    pool = torch.zeros(3, 16, MLA.row_bytes, dtype=torch.uint8)
    kv, locs = spread_rows(20, MLA.row_dim, torch.bfloat16), scattered_locs(6, 16, 20)
    quantize_write_mla_fp8(pool, kv, view(locs), PageOwnership(2, 6, "block"), 1, layout=MLA, backend=backend)
    return (pool,)


def _index_indexer(backend, view):
    pool = torch.zeros(3, 576, dtype=torch.uint8)
    k, locs = spread_rows(20, 32, torch.bfloat16, neg_zero_col=2), scattered_locs(6, 16, 20)
    quantize_write_indexer_fp8(pool, k, view(locs), PageOwnership(2, 6, "interleave"), 0, layout=IDX,
                               backend=backend)  # fmt: skip
    return (pool,)


def _index_pack(backend, view):
    pool = torch.randn(4, 3, 5, generator=_gen())
    return (torch.ops.dtkv.pack_owned_pages(pool, view(torch.tensor([3, -1, 0, 2, 1, -1])), backend),)


def _index_pack_layer(backend, view):
    pools = layer_pools(5, 3, ("fp8-row", "indexer"))
    return tuple(pack_layer_pages(pools, view(torch.tensor([4, -1, 0, 3, 7, 1])), backend=backend))


def _index_remap(backend, view):
    page_map = torch.tensor([3, -1, 2, 5, 0, 1, 4], dtype=torch.int32)
    indices = torch.tensor([[0, 17, 40, -1, 5], [27, 8, 3, 13, 22]])
    return (remap(view(indices), view(page_map), page_size=4, backend=backend),)


def _wide_pool(wide: bool) -> tuple[PageOwnership, int]:
    """A small pool (int32 kernel arithmetic), or one of 2**32 locations at page size 16 (int64 arithmetic)."""
    return (PageOwnership(1, 2**28), 2) if wide else (PageOwnership(2, 4, "interleave"), 2)


def _new_rows_pool(wide):
    return torch.randn(_wide_pool(wide)[1], 16, 8, generator=_gen())


def _write_at_rows(pool, locs, backend, validate, wide):
    rows = torch.randn(locs.shape[0], 8, generator=_gen())
    write_owned(pool, rows, locs, _wide_pool(wide)[0], 0, validate=validate, backend=backend)


def _new_fp8_pool(wide, page_shape):
    return torch.randint(0, 255, (_wide_pool(wide)[1], *page_shape), generator=_gen(), dtype=torch.uint8)


def _write_at_mla(pool, locs, backend, validate, wide):
    kv = spread_rows(locs.shape[0], MLA.row_dim, torch.bfloat16)
    quantize_write_mla_fp8(pool, kv, locs, _wide_pool(wide)[0], 0, layout=MLA, validate=validate, backend=backend)


def _write_at_indexer(pool, locs, backend, validate, wide):
    k = spread_rows(locs.shape[0], 32, torch.bfloat16, neg_zero_col=2)
    quantize_write_indexer_fp8(pool, k, locs, _wide_pool(wide)[0], 0, layout=IDX, validate=validate,
                               backend=backend)  # fmt: skip


CASES = [
    OpCase(
        name="write_owned",
        op=torch.ops.dtkv.write_owned.default,
        sample=lambda be: (
            torch.randn(3, 4, 8),
            torch.randn(6, 8),
            torch.tensor([0, 5, -1, 9, 17, 22]),
            2,
            6,
            0,
            1,
            False,
            True,
            be,
        ),  # fmt: skip
        step=_write_owned_step,
        inputs=lambda: (torch.zeros(3, 4, 8), torch.randn(10, 8, generator=_gen()), scattered_locs(6, 4, 10)),
        # 16 token locations at page size 2, rank 0 owns pages 0 2 4 6
        base=lambda: dict(
            own=PageOwnership(2, 8, "interleave"),
            pool=torch.randn(4, 2, 8),
            rows=torch.randn(4, 8),
            locs=torch.tensor([0, 5, 8, 13]),
            rank=0,
        ),  # fmt: skip
        call=_write_owned_call,
        with_index=_index_write_owned,
        new_pool=_new_rows_pool,
        write_at=_write_at_rows,
        bad=[
            ("rows dtype", dict(rows=torch.zeros(4, 8, dtype=torch.float16)), TypeError, "rows must have dtype"),
            ("rows shape", dict(rows=torch.zeros(4, 9)), ValueError, "rows must have shape [*, 8]"),
            ("locs dtype", dict(locs=torch.zeros(4)), TypeError, "locs must have dtype"),
            ("locs shape", dict(locs=torch.zeros(5, dtype=torch.int64)), ValueError, "locs must have shape [4]"),
            ("loc too large", dict(locs=torch.tensor([0, 1, 16, 2])), ValueError, "got locs[2]=16"),
            ("loc below -1", dict(locs=torch.tensor([0, -2, 1, 2])), ValueError, "got locs[1]=-2"),
            ("pool too small", dict(pool=torch.zeros(1, 2, 8)), ValueError, "but pool holds only 1 local pages"),
            ("rank", dict(rank=2), ValueError, "rank must be in [0, cp_size=2)"),
        ],
    ),
    OpCase(
        name="direct_write",  # dtkv::write_owned with direct=True
        op=torch.ops.dtkv.write_owned.default,
        sample=lambda be: (
            torch.randn(3, 4, 8),
            torch.randn(5, 8),
            torch.tensor([0, 1, 9, -1, 17]),
            2,
            6,
            0,
            0,
            True,
            True,
            be,
        ),  # fmt: skip
        # page size 2: rank 0 owns pages 0 2 4 6 8 (locs 0-1, 4-5, ...)
        base=lambda: dict(own=PageOwnership(2, 10, "interleave"), pool=torch.randn(5, 2, 6)),
        call=_direct_write_call,
        with_index=_index_direct_write,
        bad=[
            (
                "foreign page",
                dict(locs=torch.tensor([0, 1, 2, 3, 4])),
                ValueError,
                "locs[2]=2 is in logical page 1, owned by rank 1, not by rank 0",
            ),
            ("out of range", dict(locs=torch.tensor([0, 1, 40])), ValueError, "got locs[2]=40"),
            ("below -1", dict(locs=torch.tensor([-3, 1])), ValueError, "got locs[0]=-3"),
        ],  # fmt: skip
    ),
    OpCase(
        name="quantize_write_mla_fp8",
        op=torch.ops.dtkv.quantize_write_mla_fp8.default,
        sample=lambda be: (
            torch.zeros(3, 16, MLA.row_bytes, dtype=torch.uint8),
            torch.randn(5, 80).bfloat16(),
            torch.tensor([0, 17, -1, 40, 90]),
            2,
            6,
            0,
            0,
            64,
            16,
            32,
            False,
            True,
            be,
        ),  # fmt: skip
        step=_mla_step,
        inputs=lambda: (
            torch.zeros(3, 16, MLA.row_bytes, dtype=torch.uint8),
            spread_rows(20, MLA.row_dim, torch.bfloat16),
            scattered_locs(6, 16, 20),
        ),  # fmt: skip
        base=lambda: dict(
            own=PageOwnership(2, 4, "block"),
            kv=torch.randn(2, 80),
            locs=torch.tensor([0, 17]),
            pool=torch.randint(0, 255, (2, 16, MLA.row_bytes), dtype=torch.uint8),
            direct=False,
        ),
        call=_mla_call,
        with_index=_index_mla,
        new_pool=lambda wide: _new_fp8_pool(wide, (16, MLA.row_bytes)),
        write_at=_write_at_mla,
        bad=[
            ("kv dtype", dict(kv=torch.zeros(2, 80, dtype=torch.float64)), TypeError, "kv must have dtype"),
            ("kv shape", dict(kv=torch.zeros(2, 79)), ValueError, "kv must have shape [*, 80]"),
            ("pool dtype", dict(pool=torch.zeros(2, 16, 104)), TypeError, "pool must have dtype torch.uint8"),
            (
                "pool row",
                dict(pool=torch.zeros(2, 16, 100, dtype=torch.uint8)),
                ValueError,
                "pool must have shape [*, *, 104]",
            ),
            (
                "page size",
                dict(pool=torch.zeros(2, 8, 104, dtype=torch.uint8)),
                ValueError,
                "pool must have page_size=16",
            ),
            ("loc range", dict(locs=torch.tensor([0, 64])), ValueError, "got locs[1]=64"),
            (
                "direct foreign page",  # loc 16: page 1, rank 1 under interleave
                dict(
                    own=PageOwnership(2, 4, "interleave"),
                    kv=torch.randn(3, 80),
                    locs=torch.tensor([0, 16, 1]),
                    direct=True,
                ),
                ValueError,
                "locs[1]=16 is in logical page 1, owned by rank 1, not by rank 0",
            ),
        ],  # fmt: skip
    ),
    OpCase(
        name="quantize_write_indexer_fp8",
        op=torch.ops.dtkv.quantize_write_indexer_fp8.default,
        sample=lambda be: (
            torch.zeros(3, IDX.page_shape[0], dtype=torch.uint8),
            torch.randn(5, 32),
            torch.tensor([0, 17, -1, 40, 90]),
            2,
            6,
            0,
            0,
            16,
            False,
            True,
            be,
        ),  # fmt: skip
        step=_indexer_step,
        inputs=lambda: (
            torch.zeros(3, 576, dtype=torch.uint8),
            spread_rows(20, 32, torch.bfloat16, neg_zero_col=2),
            scattered_locs(6, 16, 20),
        ),  # fmt: skip
        base=lambda: dict(
            own=PageOwnership(2, 4, "interleave"),
            pool=torch.randint(0, 255, (2, 576), dtype=torch.uint8),
            k=torch.randn(2, 32),
            locs=torch.tensor([0, 33]),
            direct=False,
        ),  # fmt: skip
        call=_indexer_call,
        with_index=_index_indexer,
        new_pool=lambda wide: _new_fp8_pool(wide, IDX.page_shape),
        write_at=_write_at_indexer,
        bad=[
            ("k dtype", dict(k=torch.zeros(2, 32, dtype=torch.int32)), TypeError, "k must have dtype"),
            ("k dim", dict(k=torch.zeros(2, 31)), ValueError, "k must have shape [*, 32] (layout.head_dim)"),
            (
                "pool shape",
                dict(pool=torch.zeros(2, 500, dtype=torch.uint8)),
                ValueError,
                "pool must have shape [*, 576]",
            ),
            ("locs dtype", dict(locs=torch.tensor([0.0, 1.0])), TypeError, "locs must have dtype"),
            ("loc range", dict(locs=torch.tensor([0, 100])), ValueError, "got locs[1]=100"),
            ("foreign", dict(locs=torch.tensor([0, 16]), direct=True), ValueError, "owned by rank 1, not by rank 0"),
        ],  # fmt: skip
    ),
    OpCase(
        name="pack_owned_pages",
        op=torch.ops.dtkv.pack_owned_pages.default,
        sample=lambda be: (torch.randn(4, 3, 8), torch.tensor([2, -1, 0, 3]), be),
        step=_pack_step,
        with_index=_index_pack,
        inputs=lambda: (torch.randn(4, 4, 6, generator=_gen()), torch.tensor([[24, 25, -1], [17, 4, 13]])),
    ),
    OpCase(
        name="pack_layer_pages",
        op=torch.ops.dtkv.pack_layer_pages.default,
        sample=lambda be: (layer_pools(4, 0, ("fp8-row", "bf16-row")), torch.tensor([2, -1, 0, 3]), be),
        step=_pack_layer_step,
        inputs=lambda: (*layer_pools(5, 1, ("fp8-row", "indexer")), torch.tensor([4, 0, -1])),
        uses_ownership=False,
        with_index=_index_pack_layer,
    ),
    OpCase(
        name="remap",
        op=torch.ops.dtkv.remap.default,
        sample=lambda be: (torch.tensor([[5, -1, 2], [0, 9, 3]]), torch.tensor([2, -1, 0], dtype=torch.int32), 4, be),
        step=_remap_step,
        with_index=_index_remap,
        inputs=lambda: (torch.tensor([[0, 17, 40, -1]]),),
        uses_ownership=False,
    ),
]

# ownership of each compiled step (the ranks and pages its inputs were made for)
_STEP_OWNERSHIP = {
    "write_owned": PageOwnership(2, 6, "block"),
    "quantize_write_mla_fp8": PageOwnership(2, 6, "block"),
    "quantize_write_indexer_fp8": PageOwnership(2, 6, "interleave"),
    "pack_owned_pages": PageOwnership(2, 8, "interleave"),
}


def _compile_params():
    out = []
    for case in CASES:
        if case.step is None:
            continue
        if not case.uses_ownership:
            out.append(pytest.param(case, None, id=case.name))
            continue
        for kind in OWNERSHIP_KINDS:
            out.append(pytest.param(case, kind.values[0], id=f"{case.name}-{kind.id}", marks=kind.marks))
    return out


def _reject_params():
    return [
        pytest.param(case, what, change, exc, msg, id=f"{case.name}-{what}")
        for case in CASES
        for what, change, exc, msg in case.bad
    ]


# ----------------------------------------------------------------------------------------- the contracts
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_opcheck(case, backend):
    skip_unless(backend, "cpu")
    torch.library.opcheck(case.op, case.sample(backend))


@pytest.mark.parametrize(("case", "kind"), _compile_params())
def test_compiles_without_graph_breaks(case, kind):
    """One graph (``frame_count == 1``) with ``fullgraph=True``; outputs and mutated inputs equal eager's bytes."""
    own = as_kind(_STEP_OWNERSHIP[case.name], kind) if case.uses_ownership else None
    step = case.step(_triton_or_torch(), own)
    eager_in, compiled_in = case.inputs(), case.inputs()
    eager_out = step(*eager_in)
    cnt = CompileCounterWithBackend("aot_eager")
    compiled_out = torch.compile(step, backend=cnt, fullgraph=True)(*compiled_in)
    assert cnt.frame_count == 1
    as_tuple = lambda x: x if isinstance(x, tuple) else (x,)
    for got, want in zip(as_tuple(compiled_out) + compiled_in, as_tuple(eager_out) + eager_in):
        assert_same_bytes(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("case", "what", "change", "exc", "msg"), _reject_params())
def test_rejects_bad_input_leaving_pool_unchanged(case, what, change, exc, msg, backend):
    skip_unless(backend, "cpu")
    args = case.base()
    args.update(change)
    before = args["pool"].clone()
    with pytest.raises(exc, match=re.escape(msg)):
        case.call(args, backend)
    assert_same_bytes(args["pool"], before, "pool changed")


# ----------------------------------------------------------------------------------------- index arguments
def _step_view(t: torch.Tensor) -> torch.Tensor:
    """The same values as a strided view (stride 3, offset 1 in the last dim), other valid entries in between."""
    base = torch.stack([t.roll(1), t, t.roll(2)], dim=-1).flatten(-2)
    return base[..., 1::3]


def _transposed_view(t: torch.Tensor) -> torch.Tensor:
    """The same values through a transpose: column-major for 2-D+, a column of a ``[N, 2]`` matrix for 1-D."""
    if t.dim() >= 2:
        return t.transpose(0, 1).contiguous().transpose(0, 1)
    return torch.stack([t, t.roll(1)], dim=1)[:, 0]


VIEWS = {"step": _step_view, "transposed": _transposed_view}


@pytest.mark.parametrize("view", list(VIEWS))
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_index_arguments_with_any_strides(case, backend, view):
    """Strided index arguments give the torch backend's bytes for the contiguous arguments (Triton read
    ``locs``, ``send_idx`` and ``page_map`` as if contiguous)."""
    skip_unless(backend, "cpu")
    probe = torch.arange(6)
    assert not VIEWS[view](probe).is_contiguous() and torch.equal(VIEWS[view](probe), probe)
    want = case.with_index("torch", lambda t: t)
    for got, expect in zip(case.with_index(backend, VIEWS[view]), want):
        assert_same_bytes(got, expect)


WIDE = [2**32 + 5, 2**31 + 1, 2**32 + 16, -(2**32) + 5, 2**63 - 1]
"""int64 locations that narrow to valid int32 ones (``2**32 + 5`` -> 5) or overflow int32 arithmetic."""


@pytest.mark.parametrize("wide", [False, True], ids=["int32-math", "int64-math"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", [c for c in CASES if c.write_at], ids=[c.name for c in CASES if c.write_at])
def test_wide_locations_are_skipped_unvalidated_and_refused_validated(case, backend, wide):
    """Exactly the rows validation refuses are the rows an unvalidated write skips: the bytes of ``-1`` rows."""
    skip_unless(backend, "cpu")
    good = [5, -1, 17, 0]
    expect = case.new_pool(wide)
    case.write_at(expect, torch.tensor(good + [-1] * len(WIDE)), "torch", True, wide)
    assert not torch.equal(expect, case.new_pool(wide)), "the good rows must land"
    locs = torch.tensor(good + WIDE)
    pool = case.new_pool(wide)
    case.write_at(pool, locs, backend, False, wide)
    assert_same_bytes(pool, expect)
    pool = case.new_pool(wide)
    with pytest.raises(ValueError, match=re.escape(f"got locs[4]={WIDE[0]}")):
        case.write_at(pool, locs, backend, True, wide)
    assert_same_bytes(pool, case.new_pool(wide), "pool changed")


@pytest.mark.parametrize(
    ("op", "layout", "width", "neg_zero_col"),
    [(quantize_write_mla_fp8, MLA, MLA.row_dim, 1), (quantize_write_indexer_fp8, IDX, IDX.head_dim, 2)],
    ids=["quantize_write_mla_fp8", "quantize_write_indexer_fp8"],
)
def test_direct_is_the_owner_filter_of_own_rows_and_require_owned_is_gone(op, layout, width, neg_zero_col):
    """``direct=True`` with rows that all sit on this rank's pages stores what the owner filter stores; the 0.1
    spelling ``require_owned=`` was removed in 0.2."""
    own = PageOwnership(2, 4, "interleave")
    rows, locs = spread_rows(3, width, torch.float32, neg_zero_col=neg_zero_col), torch.tensor([0, 33, 1])
    expect = torch.zeros(2, *layout.page_shape, dtype=torch.uint8)  # pages 0 and 2 (locs 0, 1 and 33): rank 0's
    op(expect, rows, locs, own, 0, layout=layout)
    pool = torch.zeros_like(expect)
    op(pool, rows, locs, own, 0, layout=layout, direct=True)
    assert_same_bytes(pool, expect)
    assert pool.any()
    with pytest.raises(TypeError, match="require_owned"):
        op(pool, rows, locs, own, 0, layout=layout, require_owned=True)
