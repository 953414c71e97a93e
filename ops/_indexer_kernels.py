"""Triton kernels of ``dtkv::indexer_scores`` (:mod:`dtkv.ops.indexer_scores` launches them; it states the math).

Two kernels, chosen by the launch configuration (:class:`dtkv.ops.indexer_scores.IndexerLaunch`); both score a key
with the same instructions (an e4m3 or bf16 ``tl.dot`` of ``[keys, J] x [J, I]``, the relu, weight and head sum
over the accumulator's rows, the scale, the int64 packing), so they give the same bits wherever a key lands:

- :func:`indexer_pages_kernel` (``kernel="pages"``): a program walks a contiguous range of one query's page
  columns, one page per tile (``SP`` rows: the page size padded to a power of two). The page id and slot are two
  scalar loads per page, software-pipelined by Triton (``num_stages``: the pipeliner gives the dependent tile
  loads about ``num_stages / 2`` tiles of look-ahead), so no load waits on another in the steady state. The tile
  arrives by TMA (``TMA``: a 3-D descriptor of the pool's code blocks ``[P, S, J]`` and a 2-D one of its scales
  ``[P, S]``; padding, out-of-range and wholly non-causal pages are pointed out of bounds and read as zeros
  without touching memory) or by ``cp.async`` pointer loads (``TMA=False``: any alignment). ``PAGES`` pages per
  loop iteration (their loads in flight together).
- :func:`indexer_cols_kernel` (``kernel="cols"``): the first kernel, tiles of ``BLOCK_S`` key columns gathered
  column by column (any page size); kept as the sweep's baseline and for pages above 128 tokens.

Legend: ``N`` queries, ``I`` heads (``NH``, padded ``NHP``), ``J`` dims (padded ``JP``), ``P`` local pages,
``S`` page size (padded ``SP``), ``L`` page columns per query.
"""

from __future__ import annotations

from ._common import e4m3_bits, scalar_mask, tl, triton
from .selection_keys import pack_selection_key

__all__ = ["indexer_cols_kernel", "indexer_pages_kernel"]


@triton.jit
def _query_operand(q_ptr, w_ptr, n, q_sn, q_si, w_sn, NH, NHP, J, JP, Q_FP8, PREROUND):
    """Query ``n`` as the dot's ``[JP, NHP]`` operand and its head weights ``[NHP]`` (fp32; with ``Q_FP8`` the
    per-head e4m3 scale ``amax / 448`` folded in)."""
    ci = tl.arange(0, NHP)
    cj = tl.arange(0, JP)
    qm = (ci < NH)[:, None] & (cj < J)[None, :]
    w = tl.load(w_ptr + n * w_sn + ci, mask=ci < NH, other=0.0).to(tl.float32)
    q_ptrs = q_ptr + n * q_sn + ci[:, None] * q_si + cj[None, :]
    if Q_FP8:
        qf = tl.load(q_ptrs, mask=qm, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(qf), axis=1)
        pos_amax = amax > 0
        inv = tl.where(pos_amax, tl.math.div_rn(tl.zeros_like(amax) + 448.0, tl.where(pos_amax, amax, 1.0)), 1.0)
        w = w * tl.math.div_rn(amax, 448.0)  # the query's scale, folded into the head weight
        qt = tl.trans(e4m3_bits(qf * inv[:, None], PREROUND).to(tl.float8e4nv, bitcast=True))  # [JP, NHP]
    else:
        qt = tl.trans(tl.load(q_ptrs, mask=qm, other=0.0))
        if PREROUND:  # the interpreter's bf16/fp16 dot is wrong: the same products (exact) in float32
            qt = qt.to(tl.float32)
    return qt, w


@triton.jit
def _score_keys(kf, qt, w, scale, pos, valid, IMPRECISE_ACC: tl.constexpr, Q_FP8: tl.constexpr,
                PREROUND: tl.constexpr):  # fmt: skip
    """int64 selection keys of one tile: ``kf`` ``[T, JP]`` e4m3 codes, ``scale``/``pos``/``valid`` ``[T]``.

    With ``PREROUND`` (the interpreter) the dot is the products summed over ``J`` in float64, then rounded once to
    float32: the interpreter's ``tl.dot`` is numpy's matmul, whose summation order follows the BLAS kernel and the
    tile's height, so the same key would get other bits in a tile of another height. e4m3 x e4m3 products are
    multiples of 2**-18 below 2**18, so any sum of fewer than 2**17 of them is exact in float64 (in any order: the
    bits are the exact sum's); a bf16 query's products are exact and their sum runs in one order for every tile (numpy
    reduces the middle axis element by element, row by row).
    """
    if not Q_FP8:
        kf = kf.to(qt.dtype)
    if PREROUND:
        prod = kf.to(tl.float32).to(tl.float64)[:, :, None] * qt.to(tl.float32).to(tl.float64)[None, :, :]
        acc = tl.sum(prod, axis=1).to(tl.float32)  # [T, NHP]
    elif IMPRECISE_ACC > 0:
        acc = tl.dot(kf, qt, max_num_imprecise_acc=IMPRECISE_ACC)  # [T, NHP] fp32
    else:
        acc = tl.dot(kf, qt)
    s = tl.sum(tl.maximum(acc, 0.0) * w[None, :], axis=1) * scale
    return pack_selection_key(s, pos, valid)


@triton.jit
def _merged_pages(pool_ptr, row_ids, row_slots, row_keys, qt, w, qpos, start, end, num_local_pages, page_stride,
                  S, SP, J, JP, PAGES, NUM_STAGES, Q_FP8, IMPRECISE_ACC, PREROUND):  # fmt: skip
    """The page loop of :func:`indexer_pages_kernel` with ``MERGE``: rows ``u * SP + t`` of one ``[PAGES * SP, JP]``
    tile are token ``t`` of page ``first + u`` (each page's id and slot two scalar loads, then spread over its
    rows); one dot and one epilogue per ``PAGES`` pages."""
    rr = tl.arange(0, PAGES * SP)
    u = rr // SP
    t = rr - u * SP
    cj = tl.arange(0, JP)
    for first in tl.range(start, end, PAGES, num_stages=NUM_STAGES):
        pid = tl.full([PAGES * SP], -1, tl.int64)
        slot = tl.full([PAGES * SP], -1, tl.int64)
        for v in tl.static_range(PAGES):
            p = first + v
            pid_v = tl.load(row_ids + p, mask=p < end, other=-1).to(tl.int64)
            slot_v = tl.load(row_slots + p, mask=p < end, other=-1).to(tl.int64)
            pid = tl.where(u == v, pid_v, pid)
            slot = tl.where(u == v, slot_v, slot)
        ok = (pid >= 0) & (pid < num_local_pages) & (slot >= 0) & (slot * S <= qpos)
        if SP != S:
            ok = ok & (t < S)
        base = tl.where(ok, pid, 0) * page_stride
        k_ptrs = (pool_ptr + (base + t * J)[:, None] + cj[None, :]).to(tl.pointer_type(tl.float8e4nv))
        kmask = ok[:, None] if JP == J else ok[:, None] & (cj < J)[None, :]
        kf = tl.load(k_ptrs, mask=kmask, other=0.0, eviction_policy="evict_first")
        s_ptrs = (pool_ptr + base + S * J + 4 * t).to(tl.pointer_type(tl.float32))
        scale = tl.load(s_ptrs, mask=ok, other=0.0, eviction_policy="evict_first")
        pos = slot * S + t
        key = _score_keys(kf, qt, w, scale, pos, ok & (pos <= qpos), IMPRECISE_ACC, Q_FP8, PREROUND)
        store = (first + u) < end
        if SP != S:
            store = store & (t < S)
        tl.store(row_keys + (first + u) * S + t, key, mask=store)


@triton.jit(do_not_specialize=["num_page_cols", "num_local_pages", "pages_per_prog"])  # one build for every shape
def indexer_pages_kernel(
    keys_ptr,  # [N, L*S] int64, contiguous
    q_ptr,  # [N, I, J] bf16/fp16/fp32; strides (q_sn, q_si, 1)
    w_ptr,  # [N, I] floating; strides (w_sn, 1)
    pool_ptr,  # uint8 [P, S*(J+4)]; page stride page_stride (bytes), pages contiguous
    k_desc,  # TMA: e4m3 codes [P, S, J], block [1, SP, JP]; None otherwise
    s_desc,  # TMA: fp32 scales [P, S], block [1, SP]; None otherwise
    ids_ptr,  # [N, L] int32/int64, contiguous: local page read, -1 padding
    slots_ptr,  # [N, L] int32/int64, contiguous: its logical page slot, -1 padding
    qpos_ptr,  # [N] int32/int64: position of the query
    num_page_cols,  # L
    num_local_pages,  # P
    page_stride,
    q_sn,
    q_si,
    w_sn,
    pages_per_prog,
    S: tl.constexpr,
    SP: tl.constexpr,
    NH: tl.constexpr,
    NHP: tl.constexpr,
    J: tl.constexpr,
    JP: tl.constexpr,
    PAGES: tl.constexpr,
    MERGE: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    TMA: tl.constexpr,
    Q_FP8: tl.constexpr,
    PREROUND: tl.constexpr,
    IMPRECISE_ACC: tl.constexpr,
):
    """Program ``(n, c)`` scores page columns ``[c * pages_per_prog, (c + 1) * pages_per_prog)`` of query ``n``:
    ``PAGES`` pages per iteration, one tile each, or with ``MERGE`` one tile of ``PAGES * SP`` rows (pointer loads)."""
    n = tl.program_id(0).to(tl.int64)
    qt, w = _query_operand(q_ptr, w_ptr, n, q_sn, q_si, w_sn, NH, NHP, J, JP, Q_FP8, PREROUND)
    qpos = tl.load(qpos_ptr + n).to(tl.int64)
    r = tl.arange(0, SP)
    cj = tl.arange(0, JP)
    row_ids = ids_ptr + n * num_page_cols
    row_slots = slots_ptr + n * num_page_cols
    row_keys = keys_ptr + n * num_page_cols * S
    start = tl.program_id(1) * pages_per_prog
    end = tl.minimum(start + pages_per_prog, num_page_cols)
    if MERGE:
        _merged_pages(pool_ptr, row_ids, row_slots, row_keys, qt, w, qpos, start, end, num_local_pages, page_stride,
                      S, SP, J, JP, PAGES, NUM_STAGES, Q_FP8, IMPRECISE_ACC, PREROUND)  # fmt: skip
        return
    for first in tl.range(start, end, PAGES, num_stages=NUM_STAGES):
        for u in tl.static_range(PAGES):
            p = first + u
            inside = p < end
            pid = tl.load(row_ids + p, mask=inside, other=-1).to(tl.int64)
            slot = tl.load(row_slots + p, mask=inside, other=-1).to(tl.int64)
            ok = (pid >= 0) & (pid < num_local_pages) & (slot >= 0) & (slot * S <= qpos)
            if TMA:  # out-of-bounds page num_local_pages: zeros, no memory read
                pc = tl.where(ok, pid, num_local_pages).to(tl.int32)
                kf = k_desc.load([pc, 0, 0]).reshape(SP, JP)
                scale = s_desc.load([pc, 0]).reshape(SP)
            else:
                base = tl.where(ok, pid, 0) * page_stride
                k_ptrs = (pool_ptr + base + r[:, None] * J + cj[None, :]).to(tl.pointer_type(tl.float8e4nv))
                s_ptrs = (pool_ptr + base + S * J + 4 * r).to(tl.pointer_type(tl.float32))
                tile_ok = scalar_mask(ok, r[:, None] + cj[None, :], PREROUND)  # PREROUND: the interpreter
                rows_ok = scalar_mask(ok, r, PREROUND)
                if SP == S and JP == J:
                    kf = tl.load(k_ptrs, mask=tile_ok, other=0.0, eviction_policy="evict_first")
                    scale = tl.load(s_ptrs, mask=rows_ok, other=0.0, eviction_policy="evict_first")
                else:
                    kmask = tile_ok & (r < S)[:, None] & (cj < J)[None, :]
                    kf = tl.load(k_ptrs, mask=kmask, other=0.0, eviction_policy="evict_first")
                    scale = tl.load(s_ptrs, mask=rows_ok & (r < S), other=0.0, eviction_policy="evict_first")
            pos = slot * S + r
            key = _score_keys(kf, qt, w, scale, pos, ok & (pos <= qpos), IMPRECISE_ACC, Q_FP8, PREROUND)
            stored = scalar_mask(inside, r, PREROUND)
            if SP == S:
                tl.store(row_keys + p * S + r, key, mask=stored)
            else:
                tl.store(row_keys + p * S + r, key, mask=stored & (r < S))


@triton.jit(do_not_specialize=["num_cols", "num_page_cols", "num_local_pages", "tiles_per_prog"])
def indexer_cols_kernel(
    keys_ptr,  # [N, L*S] int64, contiguous
    q_ptr,  # [N, I, J] bf16/fp16/fp32; strides (q_sn, q_si, 1)
    w_ptr,  # [N, I] floating; strides (w_sn, 1)
    pool_ptr,  # uint8 [P, S*(J+4)]; page stride page_stride (bytes), pages contiguous
    ids_ptr,  # [N, L] int32/int64, contiguous: local page read, -1 padding
    slots_ptr,  # [N, L] int32/int64, contiguous: its logical page slot, -1 padding
    qpos_ptr,  # [N] int32/int64: position of the query
    num_cols,  # L * S
    num_page_cols,  # L
    num_local_pages,  # P
    page_stride,
    q_sn,
    q_si,
    w_sn,
    tiles_per_prog,
    S: tl.constexpr,
    NH: tl.constexpr,
    NHP: tl.constexpr,
    J: tl.constexpr,
    JP: tl.constexpr,
    BLOCK_S: tl.constexpr,
    Q_FP8: tl.constexpr,
    PREROUND: tl.constexpr,
    IMPRECISE_ACC: tl.constexpr,
):
    """Program ``(n, c)`` scores ``tiles_per_prog`` tiles of ``BLOCK_S`` key columns of query ``n``."""
    n = tl.program_id(0).to(tl.int64)
    qt, w = _query_operand(q_ptr, w_ptr, n, q_sn, q_si, w_sn, NH, NHP, J, JP, Q_FP8, PREROUND)
    cj = tl.arange(0, JP)
    qpos = tl.load(qpos_ptr + n).to(tl.int64)
    row_ids = ids_ptr + n * num_page_cols
    row_slots = slots_ptr + n * num_page_cols
    row_keys = keys_ptr + n * num_cols
    first = tl.program_id(1) * tiles_per_prog
    for t in range(0, tiles_per_prog):
        col = (first + t) * BLOCK_S + tl.arange(0, BLOCK_S)
        inside = col < num_cols
        pg = col // S
        off = col - pg * S
        pid = tl.load(row_ids + pg, mask=inside, other=-1).to(tl.int64)
        slot = tl.load(row_slots + pg, mask=inside, other=-1).to(tl.int64)
        pos = slot * S + off
        valid = inside & (pid >= 0) & (pid < num_local_pages) & (slot >= 0) & (pos <= qpos)
        base = tl.where(valid, pid, 0) * page_stride
        k_ptrs = (pool_ptr + (base + off * J)[:, None] + cj[None, :]).to(tl.pointer_type(tl.float8e4nv))
        kf = tl.load(k_ptrs, mask=valid[:, None] & (cj < J)[None, :], other=0.0, eviction_policy="evict_first")
        scale = tl.load((pool_ptr + base + S * J + 4 * off).to(tl.pointer_type(tl.float32)), mask=valid, other=0.0)
        key = _score_keys(kf, qt, w, scale, pos, valid, IMPRECISE_ACC, Q_FP8, PREROUND)
        tl.store(row_keys + col, key, mask=inside)
