"""``dtkv::indexer_logits``: DSA indexer logits of an extend step's queries (prefill, full-view decode) over the
fp8 indexer keys of the step's key table, ``[N, K]``, in one kernel.

Entry point: :func:`indexer_logits`; reference :func:`indexer_logits_torch`; the fp8 queries it takes:
:func:`quantize_indexer_queries`; the top-k of its output: :func:`indexer_topk`. Key column ``c`` is token slot
``key_slots[c]`` of ``pages`` (a full view or a pool of :class:`dtkv.IndexerFp8Layout` pages: token ``t`` of page
``p`` is slot ``p * S + t``), and query ``n`` sees columns ``key_start[n] <= c < key_end[n]`` (its request's keys up
to its own position: request and causal visibility in one range, as :attr:`dtkv.runtime.ExtendPlan`'s key table lays
them out). A key table with a row per query (``key_slots`` ``[N, K]``: full-view decode, where each request scores
only its own block of keys) maps query ``n``'s column ``c`` to slot ``key_slots[n, c]`` instead: one launch for the
batch, the output ``[N, K]`` linear in it::

    logits[n, c] = sum_i w[n, i] * relu(q[n, i] . codes(c)) * scale(c)        for visible c, else -inf

with ``q`` e4m3 codes and ``codes(c)``/``scale(c)`` the key's e4m3 codes and fp32 scale (a slot outside the pages is
not visible). That is ``sum_i w_i * relu(q_i . k)`` with ``k = codes * scale`` (``relu`` is positively homogeneous):
DeepSeek-V3.2's fp8 indexer, whose per-(query, head) query scale and ``softmax_scale`` are folded into ``w``
(:func:`quantize_indexer_queries`).

**Output.** float32 ``[N, K]`` (``-inf`` where not visible), or with ``packed=True`` the int64 selection keys of
those logits (:mod:`dtkv.ops.selection_keys`' order with the *column* as the position: a higher score first,
equal scores by lower column, which within a request is the lower position; ``-0.0`` folded into ``+0.0``, one NaN
above ``+inf``; :data:`INVALID_KEY` where not visible or ``-inf``): ``torch.topk`` of them is the stable
lowest-position selection rule with no sort (:func:`indexer_topk`). Never ``[N, I, K]``: the kernel sums the heads
of a tile in registers.

**Kernel.** A program takes ``block_q`` queries and a range of key tiles of ``block_k`` columns; tiles that none of
its queries sees are not computed (only stored: ``-inf``). Per tile: the key codes are gathered by slot (128-byte
rows, ``cp.async``, pipelined), one fp8 ``tl.dot`` (Hopper ``wgmma``) of all the block's queries and heads, then
relu, head weights, the head sum, the key scale, the visibility mask and the store. ``variant="keys"`` puts the
keys on the dot's M dimension and ``block_q * heads`` on N (the head sum is a reduction along N, in registers and
lane shuffles: DeepGEMM's ``fp8_mqa_logits`` arrangement); ``variant="split"`` keeps the keys on M but runs one dot
per query of the block (``block_q`` 1, 2 or 4) on the same key tile, each head sum along one accumulator row (no
reshape across queries); ``variant="queries"`` puts queries x heads on M and keys on N (the head sum crosses
warps). With ``group`` the epilogue also writes each group's largest order key (the maxima
:func:`dtkv.ops.logits_topk`'s grouped bound reads first). Programs start with the query blocks that see the most
keys (the last rows of a causal chunk); the key range of a block is split over programs only when the blocks alone
do not fill the GPU. With a key table per query a block is one query (``block_q`` 1: the keys of the dot are that
query's).

**Launch.** ``ops/_tuned.py`` op ``"indexer_logits"``, size = queries per call: ``variant``, ``block_q``,
``block_k``, ``num_warps``, ``num_stages``, ``ctas_per_sm`` (grid target for the key split), ``maxnreg``.
``benchmarks/bench_indexer_logits.py --sweep`` times candidates on a GPU and writes the table.

**FLOPs.** ``2 * I * J`` per visible (query, key) pair (:func:`indexer_logits_flops`); tiles a block computes for
keys only some of its queries see are not counted.

**Tolerance.** The reference dequantizes the keys (codes x scale, float32) and sums in float32; the kernel applies
the key scale after the head sum, and on Hopper accumulates the fp8 dot with the tensor core's reduced-precision
adder (about ``2**-13`` relative per dot). Under the interpreter: float32 rounding (~1e-6 of the row's largest
``|logit|``).

Legend: ``N`` queries, ``I`` indexer heads (``NH``, padded ``NHP``), ``J`` dims (padded ``JP``), ``K`` key
columns, ``P`` pages, ``S`` page size, ``k`` keys kept per query.
"""

from __future__ import annotations

import torch

from dtkv._checks import check_int, check_tensor
from dtkv._util import cdiv
from dtkv.layouts import IndexerFp8Layout

from . import _tuned
from ._common import device_ctx, index_arg, pow2_at_least, resolve_backend, tl, triton
from ._common import num_sms as _num_sms  # a module attribute: tests size the grid through it
from .quantize_indexer_queries import quantize_indexer_queries
from .selection_keys import INVALID_KEY, MAX_POSITION, group_order_maxima, order_key, pack_selection_key, selection_keys

__all__ = [
    "INVALID_KEY",
    "indexer_logits",
    "indexer_logits_flops",
    "indexer_logits_torch",
    "indexer_topk",
    "quantize_indexer_queries",
]

_IDX_DTYPES = (torch.int32, torch.int64)
MAX_GROUP = 128
"""Largest ``group`` of the maxima (a key tile holds whole groups: a launch's ``block_k`` grows to ``group``)."""
_REF_BLOCK_BYTES = 1 << 28
"""The reference's ``[B, I, K]`` float32 products per block of queries (bounded whatever ``N``)."""


# ----------------------------------------------------------------------------------------- torch side
def indexer_logits_torch(
    q: torch.Tensor,  # [N, I, J] e4m3 codes, uint8
    w: torch.Tensor,  # [N, I] float32
    pages: torch.Tensor,  # uint8 [P, S*(J+4)]
    key_slots: torch.Tensor,  # [K] or [N, K] int32/int64
    key_start: torch.Tensor,  # [N] int32/int64
    key_end: torch.Tensor,  # [N] int32/int64
    page_size: int,
    packed: bool,
) -> torch.Tensor:
    """Reference of :func:`indexer_logits`: dequantized keys (float32), products and head sums per block of queries
    (at most :data:`_REF_BLOCK_BYTES` of ``[B, I, K]`` products at a time), the visibility mask, the packing."""
    n, heads, hd = q.shape
    num_keys = key_slots.shape[-1]
    dev = q.device
    slots = key_slots.to(torch.int64)
    ok = (slots >= 0) & (slots < pages.shape[0] * page_size)  # [K] or [N, K]
    if pages.shape[0]:
        codes = pages[:, : page_size * hd].contiguous().view(torch.float8_e4m3fn).view(-1, hd)
        scales = pages[:, page_size * hd :].contiguous().view(torch.float32).reshape(-1)
        at = torch.where(ok, slots, torch.zeros_like(slots))
        keys = codes[at].float() * scales[at][..., None]
        keys = torch.where(ok[..., None], keys, torch.zeros_like(keys))  # [K, J] or [N, K, J]
    else:
        keys = torch.zeros((*slots.shape, hd), dtype=torch.float32, device=dev)
    per_query = slots.ndim == 2
    qf, wf = q.view(torch.float8_e4m3fn).float(), w.float()
    cols = torch.arange(num_keys, device=dev)
    lo, hi = key_start.to(torch.int64), key_end.to(torch.int64)
    out = torch.empty((n, num_keys), dtype=torch.int64 if packed else torch.float32, device=dev)
    block = max(1, _REF_BLOCK_BYTES // max(1, heads * num_keys * 4))
    for b0 in range(0, n, block):
        b1 = min(n, b0 + block)
        keys_JK = keys[b0:b1].transpose(1, 2) if per_query else keys.t()  # [B, J, K] or [J, K]
        prod = torch.matmul(qf[b0:b1], keys_JK).relu_()  # [B, I, K]
        logits = torch.matmul(wf[b0:b1, None, :], prod)[:, 0]  # [B, K]
        ok_BK = ok[b0:b1] if per_query else ok[None, :]
        vis = (cols[None, :] >= lo[b0:b1, None]) & (cols[None, :] < hi[b0:b1, None]) & ok_BK
        logits = torch.where(vis, logits, torch.full_like(logits, float("-inf")))
        out[b0:b1] = selection_keys(logits, cols) if packed else logits
    return out


def indexer_topk(keys: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` best columns of each row of packed selection keys ``[N, K]`` (``packed=True`` output, or
    :func:`dtkv.ops.selection_keys.selection_keys` of any scores with the columns as positions), best first:
    ``(cols int64 [N, k], valid bool [N, k])``, ``-1`` / False past a row's visible keys (run phase: no host sync).

    Keys are distinct (the column is part of each), so ``torch.topk`` needs no tie rule of its own: the result is
    that of a stable descending sort of the scores, ties to the lowest column.
    """
    check_int("k", k, min_value=1)
    check_tensor("keys", keys, dtype=torch.int64, ndim=2)
    n, num_keys = keys.shape
    kk = min(k, num_keys)
    cols = torch.full((n, k), -1, dtype=torch.int64, device=keys.device)
    valid = torch.zeros((n, k), dtype=torch.bool, device=keys.device)
    if kk and n:
        top = torch.topk(keys, kk, dim=1, largest=True, sorted=True)
        ok = top.values != INVALID_KEY
        valid[:, :kk] = ok
        cols[:, :kk] = torch.where(ok, top.indices, torch.full_like(top.indices, -1))
    return cols, valid


def indexer_logits_flops(key_start: torch.Tensor, key_end: torch.Tensor, *, heads: int, head_dim: int) -> int:
    """Useful FLOPs of a call: ``2 * heads * head_dim`` per visible (query, key) pair (host sync: benchmarks)."""
    seen = (key_end.to(torch.int64) - key_start.to(torch.int64)).clamp(min=0)
    return 2 * heads * head_dim * int(seen.sum())


# ----------------------------------------------------------------------------------------- Triton kernel
@triton.jit
def _store_tile(out_ptr, gmax_ptr, rows, cols, s, vis, row_ok, col_ok, out_sn, num_groups, PACKED: tl.constexpr,
                GROUP: tl.constexpr):  # fmt: skip
    """Store a ``[BQ, BK]`` tile of logits (``-inf`` where not ``vis``) or of their packed selection keys; with
    ``GROUP`` also the largest order key of each of its groups (the tile starts on a group: ``GROUP`` divides
    ``BK``)."""
    ptrs = out_ptr + rows.to(tl.int64)[:, None] * out_sn + cols[None, :]
    m = row_ok[:, None] & col_ok[None, :]
    if PACKED:
        tl.store(ptrs, pack_selection_key(s, cols[None, :], vis), mask=m)
    else:
        x = tl.where(vis, s, float("-inf"))
        tl.store(ptrs, x, mask=m)
        if GROUP > 0:
            bq: tl.constexpr = x.shape[0]
            bk: tl.constexpr = x.shape[1]
            u = tl.max(tl.reshape(order_key(x), (bq, bk // GROUP, GROUP)), axis=2)  # [BQ, BK / GROUP]
            grp = tl.min(cols, axis=0) // GROUP + tl.arange(0, bk // GROUP)
            g_ptrs = gmax_ptr + rows.to(tl.int64)[:, None] * num_groups + grp[None, :]
            tl.store(g_ptrs, u, mask=row_ok[:, None] & (grp < num_groups)[None, :])


@triton.jit
def _split_operand(q_ptr, w_ptr, rq, num_queries, q_sn, q_si, w_sn, NH: tl.constexpr, NHP: tl.constexpr,
                   J: tl.constexpr, JP: tl.constexpr):  # fmt: skip
    """Query ``rq``'s ``[NHP, JP]`` e4m3 operand and ``[NHP]`` head weights (zeros past ``num_queries``, padding
    heads and dims): one dot's operand of ``variant="split"``."""
    rq = rq.to(tl.int64)
    rh = tl.arange(0, NHP)
    cj = tl.arange(0, JP)
    ok = (rh < NH) & (rq + rh * 0 < num_queries)  # vector comparisons only: the interpreter's masks must be bool
    ptrs = (q_ptr + rq * q_sn + rh[:, None] * q_si + cj[None, :]).to(tl.pointer_type(tl.float8e4nv))
    q = tl.load(ptrs, mask=ok[:, None] & (cj < J)[None, :], other=0.0)
    w = tl.load(w_ptr + rq * w_sn + rh, mask=ok, other=0.0)
    return q, w


@triton.jit
def _split_row(out_ptr, gmax_ptr, kf, q, w, scale, rq, cols, ok, col_ok, start_ptr, end_ptr, num_queries, num_keys,
               out_sn, num_groups, PACKED: tl.constexpr, GROUP: tl.constexpr):  # fmt: skip
    """``variant="split"``: query ``rq``'s logits of one key tile, ``[BK, JP] x [JP, NHP]`` and the head sum along
    the dot's N (one row of the accumulator's layout: no reshape), stored as its row of the output."""
    acc = tl.dot(kf, tl.trans(q))  # [BK, NHP] fp32
    s = tl.sum(tl.maximum(acc, 0.0) * w[None, :], axis=1) * scale  # [BK]
    r_ok = rq + cols * 0 < num_queries  # [BK]: vector comparisons only (the interpreter's masks must be bool)
    at = tl.minimum(rq, num_queries - 1)  # a row past N (the last block's padding) reads row N - 1, stores nothing
    lo = tl.maximum(tl.load(start_ptr + at).to(tl.int64), 0)
    hi = tl.minimum(tl.load(end_ptr + at).to(tl.int64), num_keys)
    vis = (cols >= lo) & (cols < hi) & ok & r_ok
    ptrs = out_ptr + rq.to(tl.int64) * out_sn + cols
    if PACKED:
        tl.store(ptrs, pack_selection_key(s, cols, vis), mask=col_ok & r_ok)
    else:
        x = tl.where(vis, s, float("-inf"))
        tl.store(ptrs, x, mask=col_ok & r_ok)
        if GROUP > 0:
            bk: tl.constexpr = x.shape[0]
            u = tl.max(tl.reshape(order_key(x), (bk // GROUP, GROUP)), axis=1)  # [BK / GROUP]
            grp = tl.min(cols, axis=0) // GROUP + tl.arange(0, bk // GROUP)
            tl.store(
                gmax_ptr + rq.to(tl.int64) * num_groups + grp, u, mask=(rq + grp * 0 < num_queries) & (grp < num_groups)
            )


@triton.jit(do_not_specialize=["num_queries", "num_keys", "num_slots", "tiles_per_prog", "num_groups"])
def _indexer_logits_kernel(
    out_ptr,  # [N, K] float32 (int64 with PACKED); row stride out_sn
    gmax_ptr,  # with GROUP: [N, num_groups] int32, contiguous: each group's largest order key
    q_ptr,  # [N, I, J] e4m3 codes as uint8; strides (q_sn, q_si, 1)
    w_ptr,  # [N, I] float32; strides (w_sn, 1)
    pages_ptr,  # uint8 [P, S*(J+4)]; page stride page_stride (bytes), pages contiguous
    slots_ptr,  # [K] int32/int64 (or [N, K] with row stride slots_sn; BQ == 1): token slot of each key column
    start_ptr,  # [N] int32/int64, contiguous: first visible column of each query
    end_ptr,  # [N] int32/int64, contiguous: one past its last visible column
    num_queries,  # N
    num_keys,  # K
    num_slots,  # P * S
    page_stride,
    q_sn,
    q_si,
    w_sn,
    out_sn,
    slots_sn,
    tiles_per_prog,
    num_groups,  # cdiv(K, GROUP) (GROUP 0: unused)
    S: tl.constexpr,
    NH: tl.constexpr,
    NHP: tl.constexpr,
    J: tl.constexpr,
    JP: tl.constexpr,
    BQ: tl.constexpr,
    BK: tl.constexpr,
    KEYS_M: tl.constexpr,
    SPLIT: tl.constexpr,
    PACKED: tl.constexpr,
    GROUP: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """Program ``(b, c)``: query block ``cdiv(N, BQ) - 1 - b`` over the key tiles ``[c * tiles_per_prog, +
    tiles_per_prog)``; tiles outside the block's visible columns are only stored (``-inf``). A key table per query
    (``slots_sn`` its row stride, 0 for one shared table) comes with one query a block."""
    qb = tl.cdiv(num_queries, BQ) - 1 - tl.program_id(0)
    slots_ptr += qb.to(tl.int64) * slots_sn
    rows = qb * BQ + tl.arange(0, BQ)
    row_ok = rows < num_queries
    lo = tl.maximum(tl.load(start_ptr + rows, mask=row_ok, other=0).to(tl.int64), 0)
    hi = tl.minimum(tl.load(end_ptr + rows, mask=row_ok, other=0).to(tl.int64), num_keys)
    seen = hi > lo
    vis_lo = tl.min(tl.where(seen, lo, num_keys), axis=0)
    vis_hi = tl.max(tl.where(seen, hi, 0), axis=0)
    c0 = tl.program_id(1).to(tl.int64) * tiles_per_prog * BK
    c1 = tl.minimum(c0 + tiles_per_prog * BK, num_keys)
    t_lo = tl.minimum(tl.maximum(c0, vis_lo // BK * BK), c1)
    t_hi = tl.maximum(tl.minimum(c1, tl.cdiv(vis_hi, BK) * BK), t_lo)
    ck = tl.arange(0, BK).to(tl.int64)
    nothing = tl.zeros((BQ, BK), dtype=tl.float32)
    unseen = tl.zeros((BQ, BK), dtype=tl.int1)
    for c in range(c0, t_lo, BK):  # tiles before and after the block's visible columns: stored only
        _store_tile(out_ptr, gmax_ptr, rows, c + ck, nothing, unseen, row_ok, c + ck < num_keys, out_sn, num_groups,
                    PACKED, GROUP)  # fmt: skip
    for c in range(t_hi, c1, BK):
        _store_tile(out_ptr, gmax_ptr, rows, c + ck, nothing, unseen, row_ok, c + ck < num_keys, out_sn, num_groups,
                    PACKED, GROUP)  # fmt: skip
    cj = tl.arange(0, JP)
    if SPLIT:  # a dot per query (BQ of 1, 2 or 4), all on the same key tile
        q0, w0 = _split_operand(q_ptr, w_ptr, qb * BQ, num_queries, q_sn, q_si, w_sn, NH, NHP, J, JP)
        if BQ >= 2:
            q1, w1 = _split_operand(q_ptr, w_ptr, qb * BQ + 1, num_queries, q_sn, q_si, w_sn, NH, NHP, J, JP)
        if BQ >= 4:
            q2, w2 = _split_operand(q_ptr, w_ptr, qb * BQ + 2, num_queries, q_sn, q_si, w_sn, NH, NHP, J, JP)
            q3, w3 = _split_operand(q_ptr, w_ptr, qb * BQ + 3, num_queries, q_sn, q_si, w_sn, NH, NHP, J, JP)
    else:
        # the block's queries x heads, row r = query r // NHP, head r % NHP (padding heads: zero codes and weights)
        r = tl.arange(0, BQ * NHP)
        rq = (qb * BQ + r // NHP).to(tl.int64)
        rh = r % NHP
        r_ok = (rq < num_queries) & (rh < NH)
        q_ptrs = (q_ptr + rq[:, None] * q_sn + rh[:, None] * q_si + cj[None, :]).to(tl.pointer_type(tl.float8e4nv))
        qf = tl.load(q_ptrs, mask=r_ok[:, None] & (cj < J)[None, :], other=0.0)  # [BQ * NHP, JP]
        wv = tl.load(w_ptr + rq * w_sn + rh, mask=r_ok, other=0.0)  # [BQ * NHP] fp32
    for c in tl.range(t_lo, t_hi, BK, num_stages=NUM_STAGES):
        cols = c + ck
        col_ok = cols < num_keys
        slot = tl.load(slots_ptr + cols, mask=col_ok, other=-1).to(tl.int64)
        ok = col_ok & (slot >= 0) & (slot < num_slots)
        slot = tl.where(ok, slot, 0)
        page = slot // S
        off = slot - page * S
        base = page * page_stride
        k_ptrs = (pages_ptr + (base + off * J)[:, None] + cj[None, :]).to(tl.pointer_type(tl.float8e4nv))
        kf = tl.load(k_ptrs, mask=ok[:, None] & (cj < J)[None, :], other=0.0)  # [BK, JP]
        s_ptrs = (pages_ptr + base + S * J + 4 * off).to(tl.pointer_type(tl.float32))
        scale = tl.load(s_ptrs, mask=ok, other=0.0)  # [BK]
        if SPLIT:
            q_row = qb * BQ
            _split_row(out_ptr, gmax_ptr, kf, q0, w0, scale, q_row, cols, ok, col_ok, start_ptr, end_ptr, num_queries,
                       num_keys, out_sn, num_groups, PACKED, GROUP)  # fmt: skip
            if BQ >= 2:
                _split_row(out_ptr, gmax_ptr, kf, q1, w1, scale, q_row + 1, cols, ok, col_ok, start_ptr, end_ptr,
                           num_queries, num_keys, out_sn, num_groups, PACKED, GROUP)  # fmt: skip
            if BQ >= 4:
                _split_row(out_ptr, gmax_ptr, kf, q2, w2, scale, q_row + 2, cols, ok, col_ok, start_ptr, end_ptr,
                           num_queries, num_keys, out_sn, num_groups, PACKED, GROUP)  # fmt: skip
                _split_row(out_ptr, gmax_ptr, kf, q3, w3, scale, q_row + 3, cols, ok, col_ok, start_ptr, end_ptr,
                           num_queries, num_keys, out_sn, num_groups, PACKED, GROUP)  # fmt: skip
        elif KEYS_M:
            acc = tl.dot(kf, tl.trans(qf))  # [BK, BQ * NHP] fp32
            s = tl.maximum(acc, 0.0) * wv[None, :]
            s = tl.trans(tl.sum(tl.reshape(s, (BK, BQ, NHP)), axis=2) * scale[:, None])  # [BQ, BK]
        else:
            acc = tl.dot(qf, tl.trans(kf))  # [BQ * NHP, BK] fp32
            s = tl.maximum(acc, 0.0) * wv[:, None]
            s = tl.sum(tl.reshape(s, (BQ, NHP, BK)), axis=1) * scale[None, :]  # [BQ, BK]
        if not SPLIT:
            vis = (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None]) & ok[None, :]
            _store_tile(out_ptr, gmax_ptr, rows, cols, s, vis, row_ok, col_ok, out_sn, num_groups, PACKED, GROUP)


# ----------------------------------------------------------------------------------------- launch
_VARIANTS = ("keys", "queries", "split")


def launch_grid(num_queries: int, num_keys: int, cfg: dict, device: torch.device) -> tuple[int, int, int]:
    """``(query blocks, key splits, tiles per program)`` of a call (the key split only where the query blocks
    alone do not reach ``ctas_per_sm`` programs per SM; at most 65535 splits)."""
    blocks = cdiv(num_queries, int(cfg["block_q"]))
    tiles = cdiv(num_keys, int(cfg["block_k"]))
    target = _num_sms(device) * int(cfg["ctas_per_sm"])
    splits = min(tiles, 65535, max(1, cdiv(target, blocks)))
    per = cdiv(tiles, splits)
    return blocks, cdiv(tiles, per), per


def _triton_takes(pages: torch.Tensor, page_size: int, head_dim: int) -> str:
    """Why the kernel cannot take these pages ('' when it can)."""
    if (page_size * head_dim) % 4 or pages.stride(0) % 4 or pages.storage_offset() % 4:
        return (
            "the scales' byte offsets are not multiples of 4 (page_size * head_dim, the pages' stride and offset "
            f"must be), got page_size={page_size}, head_dim={head_dim}, pages.stride()={pages.stride()}, "
            f"pages.storage_offset()={pages.storage_offset()}"
        )
    return ""


def _launch(out, gmax, q, w, pages, slots, start, end, page_size: int, packed: bool, group: int) -> None:
    n, heads, hd = q.shape
    cfg = _tuned.launch_config("indexer_logits", n, q.device)
    if group > int(cfg["block_k"]):  # a tile holds whole groups (both powers of two)
        cfg = {**cfg, "block_k": group}
    if cfg["variant"] not in _VARIANTS:
        raise ValueError(f"indexer_logits variant must be one of {_VARIANTS}, got variant={cfg['variant']!r}")
    if cfg["variant"] == "split" and int(cfg["block_q"]) not in (1, 2, 4):
        raise ValueError(f"indexer_logits variant 'split' takes block_q 1, 2 or 4, got block_q={cfg['block_q']}")
    slots_sn = 0
    if slots.ndim == 2:  # a key table per query: one query a block
        cfg = {**cfg, "block_q": 1}
        slots = slots if slots.stride(1) == 1 else slots.contiguous()
        slots_sn = slots.stride(0)
    blocks, splits, per = launch_grid(n, slots.shape[-1], cfg, q.device)
    q = q if q.stride(2) == 1 else q.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    with device_ctx(q.device):
        _indexer_logits_kernel[(blocks, splits)](
            out, gmax, q, w, pages, slots, start, end,
            n, slots.shape[-1], pages.shape[0] * page_size, pages.stride(0), q.stride(0), q.stride(1), w.stride(0),
            out.stride(0), slots_sn, per, gmax.shape[1],
            S=page_size, NH=heads, NHP=pow2_at_least(heads, 16), J=hd, JP=pow2_at_least(hd, 32),
            BQ=int(cfg["block_q"]), BK=int(cfg["block_k"]), KEYS_M=cfg["variant"] != "queries",
            SPLIT=cfg["variant"] == "split", PACKED=packed, GROUP=group,
            NUM_STAGES=int(cfg["num_stages"]), num_warps=int(cfg["num_warps"]), num_stages=int(cfg["num_stages"]),
            maxnreg=int(cfg["maxnreg"]) or None,
        )  # fmt: skip


def _check(q, w, pages, key_slots, key_start, key_end, page_size, packed=False, group=0) -> None:
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got page_size={page_size}")
    if group < 0 or group == 1 or group & (group - 1) or group > MAX_GROUP:
        raise ValueError(f"group must be 0 (none) or a power of two in [2, {MAX_GROUP}], got group={group}")
    if group and packed:
        raise ValueError(f"group must be 0 with packed=True (the maxima come with float32 logits), got group={group}")
    check_tensor("q", q, dtype=torch.uint8, ndim=3)  # e4m3 codes (the wrapper's float8_e4m3fn, viewed)
    n, heads, hd = q.shape
    dev = q.device
    check_tensor("w", w, dtype=torch.float32, shape=(n, heads), device=dev)
    check_tensor("pages", pages, dtype=torch.uint8, shape=(None, page_size * (hd + 4)), device=dev)
    if pages.shape[0] and pages.stride(1) != 1:
        raise ValueError(f"pages must be contiguous within a page (stride 1 in dim 1), got {pages.stride()}")
    check_tensor("key_slots", key_slots, dtype=_IDX_DTYPES, device=dev)
    if key_slots.ndim not in (1, 2) or (key_slots.ndim == 2 and key_slots.shape[0] != n):
        raise ValueError(
            f"key_slots must be [K] (one key table) or [N, K] with N = {n} queries (a table per query), got "
            f"shape {list(key_slots.shape)}"
        )
    if key_slots.shape[-1] > MAX_POSITION:  # a column is a selection key's position
        raise ValueError(f"key_slots must have fewer than 2**32 - 1 columns, got {key_slots.shape[-1]}")
    check_tensor("key_start", key_start, dtype=_IDX_DTYPES, shape=(n,), device=dev)
    check_tensor("key_end", key_end, dtype=_IDX_DTYPES, shape=(n,), device=dev)


# ----------------------------------------------------------------------------------------- registered op
@torch.library.custom_op("dtkv::indexer_logits", mutates_args=())
def _indexer_logits_op(
    q: torch.Tensor,
    w: torch.Tensor,
    pages: torch.Tensor,
    key_slots: torch.Tensor,
    key_start: torch.Tensor,
    key_end: torch.Tensor,
    page_size: int,
    packed: bool,
    group: int,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check(q, w, pages, key_slots, key_start, key_end, page_size, packed, group)
    slots, start, end = index_arg(key_slots), index_arg(key_start), index_arg(key_end)
    n, num_keys = q.shape[0], slots.shape[-1]
    if backend != "triton":
        out = indexer_logits_torch(q, w, pages, slots, start, end, page_size, packed)
        gmax = group_order_maxima(out, group) if group else out.new_empty((n, 0), dtype=torch.int32)
        return out, gmax
    why = _triton_takes(pages, page_size, q.shape[2])
    if why:
        raise NotImplementedError(f"backend='triton' for indexer_logits cannot run: {why}; use backend='torch'")
    out = torch.empty((n, num_keys), dtype=torch.int64 if packed else torch.float32, device=q.device)
    gmax = torch.empty((n, cdiv(num_keys, group) if group else 0), dtype=torch.int32, device=q.device)
    if out.numel():
        _launch(out, gmax, q, w, pages, slots, start, end, page_size, packed, group)
    return out, gmax


@_indexer_logits_op.register_fake
def _fake_indexer_logits(q, w, pages, key_slots, key_start, key_end, page_size, packed, group, backend):
    _check(q, w, pages, key_slots, key_start, key_end, page_size, packed, group)
    n, num_keys = q.shape[0], key_slots.shape[-1]
    out = q.new_empty((n, num_keys), dtype=torch.int64 if packed else torch.float32)
    return out, q.new_empty((n, cdiv(num_keys, group) if group else 0), dtype=torch.int32)


# ----------------------------------------------------------------------------------------- public wrapper
def indexer_logits(
    q: torch.Tensor,
    w: torch.Tensor,
    pages: torch.Tensor,
    key_slots: torch.Tensor,
    key_start: torch.Tensor,
    key_end: torch.Tensor,
    *,
    layout: IndexerFp8Layout,
    packed: bool = False,
    group: int = 0,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Indexer logits of each query over its visible key columns (see the module docstring).

    Run phase: no host synchronization, no data-dependent shapes (CUDA-graph safe).

    Args:
        q: fp8 indexer queries, float8_e4m3fn ``[N, I, layout.head_dim]`` (:func:`quantize_indexer_queries`), last
            dim contiguous.
        w: float32 head weights ``[N, I]`` (the queries' scales and the indexer's ``softmax_scale`` folded in).
        pages: uint8 ``[P, layout.page_size * (layout.head_dim + 4)]`` fp8 indexer pages of one layer (a full view
            or a pool; pages contiguous, any page stride).
        key_slots: int32/int64 ``[K]`` token slot in ``pages`` of each key column (outside ``[0, P * S)``: never
            visible), or ``[N, K]``: a key table per query (row ``n`` is query ``n``'s columns).
        key_start, key_end: int32/int64 ``[N]`` the visible columns ``[key_start[n], key_end[n])`` of each query
            (clamped to ``[0, K]``; empty when ``key_end <= key_start``).
        layout: the pages' layout.
        packed: return int64 selection keys instead of float32 logits.
        group: ``0``, or a power of two in ``[2, MAX_GROUP]``: also return each group of ``group`` consecutive
            columns' largest order key (:func:`dtkv.ops.selection_keys.group_order_maxima` of the logits), what
            :func:`dtkv.ops.logits_topk`'s grouped bound reads first (its ``group_max``): written by the kernel's
            epilogue, no second pass over ``[N, K]`` (float32 logits only).
        backend: ``"auto"`` (Triton on CUDA where the kernel takes the pages, else torch) | ``"torch"`` |
            ``"triton"``.

    Returns:
        float32 ``[N, K]`` logits, ``-inf`` where not visible; with ``packed``, int64 ``[N, K]`` selection keys,
        :data:`INVALID_KEY` where not visible. With ``group``: ``(logits, maxima)``, ``maxima`` int32
        ``[N, cdiv(K, group)]`` (:data:`dtkv.ops.selection_keys.NO_ORDER_KEY` for a group with no visible key).

    Raises:
        TypeError / ValueError: bad dtypes or shapes, naming the argument; ``group`` not a power of two in
            ``[2, MAX_GROUP]`` (nor 0), or given with ``packed``.
        NotImplementedError: ``backend="triton"`` with pages whose scales are not 4-byte aligned.
    """
    if not isinstance(layout, IndexerFp8Layout):
        raise TypeError(f"layout must be a dtkv.IndexerFp8Layout, got {type(layout).__name__}")
    check_tensor("q", q, dtype=torch.float8_e4m3fn, ndim=3)
    if q.shape[2] != layout.head_dim:
        raise ValueError(f"q must have shape [*, *, {layout.head_dim}] (layout.head_dim), got {list(q.shape)}")
    be = resolve_backend(backend, q.device)
    if be == "triton" and backend == "auto" and _triton_takes(pages, layout.page_size, layout.head_dim):
        be = "torch"
    codes = q.view(torch.uint8)  # the op takes the codes as bytes (float8 tensors have few CPU kernels)
    out, gmax = torch.ops.dtkv.indexer_logits(
        codes, w, pages, key_slots, key_start, key_end, layout.page_size, packed, group, be
    )
    return (out, gmax) if group else out
