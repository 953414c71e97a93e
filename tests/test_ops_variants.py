"""Every kernel variant and launch configuration of ``ops/_tuned.py`` writes the reference's bytes.

The ops read their launch configuration from a table (``ops/_tuned.py``) that picks, per size, among kernel
variants: the row copy's chunking and flat tiles (``ops/_copy.py``), the owner filter's tile and window kernels, the
pack's pages per program and parts per page, remap's 2-byte map copy. Each case here forces one configuration
(:func:`dtkv.ops._tuned.override`) and compares bitwise with the independent references of
``tests/ops_reference.py``: rows in token order (runs of whole pages: the window kernel's dense tiles of step 1),
round robin (every cp-th row: step cp, windows broken by ``-1`` rows take the masked path) and at random, partial
last pages, ``-1`` rows, ranks that store no pages, rows of
82 and 144 int64 words and of 3 int32 or 5 byte words (chunks that end mid-way, a masked fourth chunk). No
tolerances: the ops copy bytes and the quantizers do the same IEEE arithmetic as the reference.
``test_every_tune_candidate_matches_torch`` runs each candidate of ``benchmarks/tune_ops.py`` the way its sweep does.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from dtkv import IndexerFp8Layout, MLAFp8Layout, PageOwnership
from dtkv.ops import (
    pack_layer_pages,
    quantize_write_indexer_fp8,
    quantize_write_mla_fp8,
    remap,
    write_owned,
)
from dtkv.ops._tuned import override
from tests.ops_reference import (
    address_check,
    assert_same_bytes,
    backend_ok,
    covering,
    ref_indexer_write,
    ref_mla_row,
    ref_remap,
    ref_write_rows,
    spread_rows,
)

VARIANTS: dict[str, list[dict]] = {
    "write_owned": [
        {"variant": "tile", "layout": "rows", "block_r": 4, "chunk_w": 128},
        {"variant": "tile", "layout": "rows", "block_r": 16, "chunk_w": 0},
        {"variant": "tile", "layout": "flat", "block_r": 4, "chunk_w": 128},
        {"variant": "tile", "layout": "flat", "block_r": 8, "chunk_w": 2},
        {"variant": "window", "layout": "rows", "window": 8, "block_r": 4},
        {"variant": "window", "layout": "flat", "window": 16, "block_r": 4, "chunk_w": 4},
        {"variant": "window", "layout": "rows", "window": 4, "block_r": 4, "chunk_w": 2},
        {"variant": "window", "layout": "flat", "window": 32, "block_r": 2, "chunk_w": 0},
    ],
    "direct_write": [
        {"layout": "rows", "block_r": 4, "chunk_w": 128},
        {"layout": "rows", "block_r": 8, "chunk_w": 0},
        {"layout": "rows", "block_r": 2, "chunk_w": 2},
        {"layout": "rows", "block_r": 16, "chunk_w": 8},
        {"layout": "flat", "block_r": 4, "chunk_w": 0},
        {"layout": "flat", "block_r": 8, "chunk_w": 16},
        {"layout": "flat", "block_r": 1, "chunk_w": 128},
    ],
    "quantize_write_mla_fp8": [{"block_r": 1}, {"block_r": 2}, {"block_r": 8}],
    "quantize_write_indexer_fp8": [{"block_r": 1}, {"block_r": 4}, {"block_r": 32}],
    "pack_layer_pages": [
        {"rows": 1, "parts": 1, "chunk_w": 4096},
        {"rows": 2, "parts": 2, "chunk_w": 2},
        {"rows": 4, "parts": 4, "chunk_w": 0},
        {"rows": 1, "parts": 8, "chunk_w": 1},
    ],
    "remap": [
        {"map16": "never", "block": 16},
        {"map16": "always", "block": 8},
        {"map16": "always", "idx_cg": 1, "block": 32},
        {"map16": "large", "idx_cg": 1},
    ],
}
"""Configurations reaching every code path of the kernels (chunks that end mid-row, a masked fourth chunk, windows
of one and of several programs)."""
VARIANTS["pack_owned_pages"] = VARIANTS["pack_layer_pages"]


def _ids(op: str) -> list:
    return [pytest.param(c, id="-".join(f"{k}{v}" for k, v in c.items())) for c in VARIANTS[op]]


@pytest.fixture(autouse=True)
def _triton_runs():
    if not backend_ok("triton", "cpu"):
        pytest.skip("Triton cannot run on the CPU here (missing, or no TRITON_INTERPRET=1)")


@pytest.fixture(autouse=True, scope="module")
def _in_bounds():
    """Every kernel launch here also has each active lane's address checked against its tensor arguments."""
    with address_check():
        yield


def _table(n: int, dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:
        return torch.randint(0, 256, (n, dim), generator=g, dtype=torch.uint8)
    return torch.randn(n, dim, generator=g).to(dtype)


# ----------------------------------------------------------------------------------------- row writes
ROW_KINDS = {  # (dtype, dim): 656 B = 82 int64 words (64+16+2), 1152 B = 144, 12 B = 3 int32, 5 bytes
    "fp8row": (torch.uint8, 656),
    "bf16row": (torch.bfloat16, 576),
    "3words": (torch.float32, 3),
    "5bytes": (torch.uint8, 5),
}
GEOMETRIES = {  # (cp, num_pages, scheme, page_size, row order)
    "cp4-runs": (4, 13, "interleave", 8, "token"),
    "cp4-random": (4, 13, "interleave", 8, "random"),
    "cp4-roundrobin": (4, 13, "interleave", 8, "roundrobin"),
    "cp3-block-emptyrank": (3, 4, "block", 3, "random"),  # pages per rank [2, 2, 0]
}
FILTER_CASES = [
    pytest.param(g, k, id=f"{g}-{k}")
    for g, k in [("cp4-runs", "fp8row"), ("cp4-runs", "3words"), ("cp4-random", "bf16row"), ("cp4-random", "5bytes"),
                 ("cp4-roundrobin", "fp8row"), ("cp4-roundrobin", "5bytes"), ("cp3-block-emptyrank", "fp8row"),
                 ("cp3-block-emptyrank", "3words")]
]  # fmt: skip


def _chunk_locs(own: PageOwnership, ps: int, order: str, seed: int) -> torch.Tensor:
    """A full chunk's locations: every page but a partial last one, in token order, round robin or shuffled, some
    ``-1``."""
    n = own.num_pages * ps - (ps // 2)
    locs = torch.arange(n)
    if order == "roundrobin":  # offset t of every page, then t + 1: consecutive rows cycle through the owners
        locs = (torch.arange(own.num_pages)[None, :] * ps + torch.arange(ps)[:, None]).flatten()
        locs = locs[locs < n]
    if order == "random":
        locs = locs[torch.randperm(n, generator=torch.Generator().manual_seed(seed))]
    locs[5::11] = -1
    return locs


@pytest.mark.parametrize(
    ("cfg", "case"),
    covering(
        cfg={p.id: p.values[0] for p in _ids("write_owned")},
        case={p.id: p.values for p in FILTER_CASES},
    ),
)
def test_owner_filter_variants_vs_reference(cfg, case):
    geometry, kind = case
    (cp, num_pages, scheme, ps, order), (dtype, dim) = GEOMETRIES[geometry], ROW_KINDS[kind]
    own = PageOwnership(cp, num_pages, scheme)
    locs = _chunk_locs(own, ps, order, seed=num_pages)
    rows = _table(locs.shape[0], dim, dtype, seed=1)
    with override("write_owned", **cfg):
        for rank in (0, cp - 1):
            start = _table(own.num_local_pages(rank) * ps, dim, dtype, seed=rank + 2).view(-1, ps, dim)
            pool = start.clone()
            write_owned(pool, rows, locs, own, rank, validate=False, backend="triton")
            assert_same_bytes(pool, ref_write_rows(start, rows, locs, own, rank), f"rank {rank}")


@pytest.mark.parametrize("cfg", _ids("direct_write"))
@pytest.mark.parametrize("kind,idx_dtype", [("fp8row", torch.int32), ("bf16row", torch.int64),
                                            ("3words", torch.int64), ("5bytes", torch.int32)])  # fmt: skip
def test_direct_write_variants_vs_reference(cfg, kind, idx_dtype):
    (dtype, dim), own, ps = ROW_KINDS[kind], PageOwnership(3, 11, "interleave"), 4
    for rank in (0, 2):
        mine = own.local_pages(rank)
        locs = (mine[:, None] * ps + torch.arange(ps)).flatten()[:-1]  # this rank's pages, a partial last one
        locs = locs[torch.randperm(locs.shape[0], generator=torch.Generator().manual_seed(rank))]
        locs[::7] = -1
        rows = _table(locs.shape[0], dim, dtype, seed=rank)
        start = _table(own.num_local_pages(rank) * ps, dim, dtype, seed=9).view(-1, ps, dim)
        pool = start.clone()
        with override("direct_write", **cfg):
            write_owned(pool, rows, locs.to(idx_dtype), own, rank, direct=True, backend="triton")
        assert_same_bytes(pool, ref_write_rows(start, rows, locs, own, rank), f"rank {rank}")


# ----------------------------------------------------------------------------------------- quantizing writes
@pytest.mark.parametrize("cfg", _ids("quantize_write_mla_fp8"))
@pytest.mark.parametrize("direct", [False, True], ids=["filter", "direct"])
def test_quantize_write_mla_fp8_variants_vs_reference(cfg, direct):
    lay = MLAFp8Layout(page_size=4, kv_lora_rank=16, rope_dim=4, quant_block=4)
    own = PageOwnership(3, 5, "block")
    for rank in range(3):
        locs = torch.arange(5 * 4 - 1) if not direct else (own.local_pages(rank)[:, None] * 4 + torch.arange(4))
        locs = locs.flatten()
        locs[3::5] = -1
        kv = spread_rows(locs.shape[0], lay.row_dim, torch.bfloat16, seed=rank)
        start = _table(own.num_local_pages(rank) * 4, lay.row_bytes, torch.uint8, seed=rank).view(-1, 4, lay.row_bytes)
        pool = start.clone()
        with override("quantize_write_mla_fp8", **cfg):
            quantize_write_mla_fp8(pool, kv, locs, own, rank, layout=lay, direct=direct, backend="triton")
        want = ref_write_rows(start, torch.stack([ref_mla_row(r, lay) for r in kv]), locs, own, rank)
        assert_same_bytes(pool, want, f"rank {rank}")


@pytest.mark.parametrize("cfg", _ids("quantize_write_indexer_fp8"))
@pytest.mark.parametrize("head_dim", [8, 128])
@pytest.mark.parametrize("direct", [False, True], ids=["filter", "direct"])
def test_quantize_write_indexer_fp8_variants_vs_reference(cfg, head_dim, direct):
    lay = IndexerFp8Layout(page_size=4, head_dim=head_dim)
    own = PageOwnership(2, 7, "interleave")
    for rank in range(2):
        locs = torch.arange(7 * 4 - 2) if not direct else (own.local_pages(rank)[:, None] * 4 + torch.arange(4))
        locs = locs.flatten()
        locs[2::6] = -1
        k = spread_rows(locs.shape[0], head_dim, torch.float32, seed=rank)
        start = _table(own.num_local_pages(rank), lay.page_shape[0], torch.uint8, seed=rank)
        pool = start.clone()
        with override("quantize_write_indexer_fp8", **cfg):
            quantize_write_indexer_fp8(pool, k, locs, own, rank, layout=lay, direct=direct, backend="triton")
        assert_same_bytes(pool, ref_indexer_write(start, k, locs, own, rank, lay), f"rank {rank}")


# ----------------------------------------------------------------------------------------- packs
def _pages(pool: torch.Tensor, send: list[int]) -> torch.Tensor:
    out = torch.zeros((len(send), *pool.shape[1:]), dtype=pool.dtype)
    for m, p in enumerate(send):
        if 0 <= p < pool.shape[0]:
            out[m] = pool[p]
    return out


SEND = [6, -1, 0, 13, 2, 2, 5, 1, -7, 3, 4, 6, 0]
"""Send rows: pages of a 7-page pool, ``-1`` and others outside it (zero pages), repeats; 13 rows (not a multiple
of the rows per program)."""


@pytest.mark.parametrize("cfg", _ids("pack_layer_pages"))
def test_pack_layer_pages_variants_vs_reference(cfg):
    g = torch.Generator().manual_seed(3)
    pools = [  # 5 rows of 656 B (410 words), 528 B (66 words), 7 bytes, a bf16 layer view with a page stride
        torch.randint(0, 256, (7, 5, 656), generator=g, dtype=torch.uint8),
        torch.randint(0, 256, (7, 528), generator=g, dtype=torch.uint8),
        torch.randint(0, 256, (7, 7), generator=g, dtype=torch.uint8),
        torch.randn(3, 7, 2, 6, generator=g).to(torch.bfloat16)[1],
    ]
    for k in (1, 2, 4):
        with override("pack_layer_pages", **cfg):
            got = pack_layer_pages(pools[:k], torch.tensor(SEND), backend="triton")
        for i, (o, p) in enumerate(zip(got, pools)):
            assert_same_bytes(o, _pages(p, SEND), f"{k} layouts, layout {i}")


@pytest.mark.parametrize("cfg", _ids("pack_owned_pages"))
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_pack_owned_pages_variants_vs_reference(cfg, idx_dtype):
    pool = torch.randint(0, 256, (7, 3, 656), generator=torch.Generator().manual_seed(4), dtype=torch.uint8)
    with override("pack_owned_pages", **cfg):
        got = torch.ops.dtkv.pack_owned_pages(pool, torch.tensor(SEND, dtype=idx_dtype), "triton")
    assert_same_bytes(got, _pages(pool, SEND))


# ----------------------------------------------------------------------------------------- remap
MAP = [0, 5, -1, 0xFFFD, 0xFFFE, 0xFFFF, 70000, -5, 2**31 - 1, 3]
"""Entries around the 2-byte copy's codes (0xFFFE: read the full entry; 0xFFFF: negative), past 16 bits, and one
whose ``* page_size`` wraps in int32 (the reference narrows the int64 result)."""


@pytest.mark.parametrize("cfg", _ids("remap"))
@pytest.mark.parametrize("map_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("page_size", [1, 16])
def test_remap_variants_vs_reference(cfg, map_dtype, dtype, page_size):
    values = MAP + ([2**40 + 7] if map_dtype == torch.int64 else [])
    page_map = torch.tensor(values, dtype=map_dtype)
    x = torch.arange(-2, (len(values) + 2) * page_size, max(1, page_size // 5), dtype=dtype)  # every page, and past
    x = torch.cat([x, x.flip(0)]).view(2, -1)
    with override("remap", **cfg):
        got = remap(x, page_map, page_size=page_size, backend="triton")
    want = ref_remap(x.to(torch.int64), values, page_size)
    if dtype == torch.int32:  # int32 indices: the low 32 bits of the int64 result, two's complement
        want = (want + 2**31) % 2**32 - 2**31
    assert torch.equal(got, want.to(dtype))


# ----------------------------------------------------------------------------------------- the sweep's candidates
def _tune_ops():
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "tune_ops.py"
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location("tune_ops", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # > 10 s on 2 cores for write_owned's 42 candidates: outside the quick subset (-m 'not slow')
@pytest.mark.parametrize(
    "op",
    ["write_owned", "direct_write", "quantize_write_mla_fp8", "quantize_write_indexer_fp8", "pack_owned_pages",
     "pack_layer_pages", "remap", "dequantize_mla_rows", "rope_interleave_into"],
)  # fmt: skip
def test_every_tune_candidate_matches_torch(op):
    """What the GPU sweep does first, on 20 tokens (a partial page, so the owner filter's rows interleave): every
    candidate, completed from DEFAULTS, runs and gives the torch backend's bytes on every scenario of its op."""
    T = _tune_ops()
    scenarios = [make(20, torch.device("cpu")) for make in T.B.SCENARIOS[op]]
    seen = []  # num_warps changes nothing under the interpreter: each other combination once
    for cand in T.CANDIDATES[op]:
        key = {k: v for k, v in T.full(op, cand).items() if k != "num_warps"}
        if key in seen:
            continue
        seen.append(key)
        with override(op, **T.full(op, cand)):
            for s in scenarios:
                assert s.verify() is None, f"{op} {cand}: {s.op}"


# ----------------------------------------------------------------------------------------- int64 offsets
def test_int64_offsets_give_the_same_bytes(monkeypatch):
    """The kernels' int64 offset arithmetic (taken when a tensor's word offsets may reach 2**31, too large to test
    here) forced on small inputs: the same bytes as the references."""
    for name in ("write_owned", "quantize_write_mla_fp8", "quantize_write_indexer_fp8", "pack_layer_pages", "remap"):
        # the modules (dtkv.ops exports functions of the same names)
        monkeypatch.setattr(importlib.import_module(f"dtkv.ops.{name}"), "needs_int64", lambda *extents: True)
    v = VARIANTS
    test_owner_filter_variants_vs_reference(v["write_owned"][2], ("cp4-random", "fp8row"))
    test_owner_filter_variants_vs_reference(v["write_owned"][3], ("cp4-runs", "3words"))
    test_owner_filter_variants_vs_reference(v["write_owned"][0], ("cp3-block-emptyrank", "5bytes"))
    test_direct_write_variants_vs_reference(v["direct_write"][0], "bf16row", torch.int64)
    for direct in (False, True):
        test_quantize_write_mla_fp8_variants_vs_reference(v["quantize_write_mla_fp8"][1], direct)
        test_quantize_write_indexer_fp8_variants_vs_reference(v["quantize_write_indexer_fp8"][1], 8, direct)
    test_pack_layer_pages_variants_vs_reference(v["pack_layer_pages"][1])
    test_pack_owned_pages_variants_vs_reference(v["pack_owned_pages"][0], torch.int32)
    test_remap_variants_vs_reference(v["remap"][2], torch.int64, torch.int32, 16)
