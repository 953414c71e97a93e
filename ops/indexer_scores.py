"""``dtkv::indexer_scores``: DSA indexer scores of decode queries over the fp8 indexer pages they read, packed as
selection keys, in one kernel.

Entry point: :func:`indexer_scores`; reference :func:`indexer_scores_torch`. Query ``n`` reads the ``L`` pages
``page_ids[n]`` (local rows of a pool of :class:`dtkv.IndexerFp8Layout` pages, ``-1`` padding); page ``l`` holds
the request's logical page ``page_slots[n, l]``, so its token ``t`` sits at position ``page_slots[n, l] * S + t``.
For every such key::

    score[n, s] = sum_i w[n, i] * relu(q[n, i] . k[s])        k[s] = e4m3 codes of token s * its fp32 scale

masked (:data:`dtkv.decode.INVALID_KEY`) where the page is padding or the key is not causal (position >
``query_pos[n]``), and packed with its position into the int64 key of :func:`dtkv.decode.selection_keys` (score
rounded to float32, ties by position): ``torch.topk`` of the output *is* the selection rule. Output column
``l * S + t`` is token ``t`` of page ``l``.

**Query precision** (``q_fp8``). ``q_fp8=True`` quantizes each (query, head) row of ``q`` to e4m3 with the scale
``amax / 448`` and folds the scale into the head weight (``relu`` is positively homogeneous), as DeepSeek-V3.2's
indexer does: the dot is then fp8 x fp8 on the tensor cores (twice the bf16 rate), which is what keeps the kernel at
memory bandwidth: every key costs ``2 * I * J`` flops for its ``J + 4`` bytes (124 flop/byte at ``I = 64``,
``J = 128``: HBM speed needs ~600 TFLOP/s, beyond what a bf16 dot sustains). The price is e4m3 rounding of the
queries (up to 2**-4 relative per element), so the selection differs from that of unquantized queries at
near-ties; every mode of a decode step (sharded, full view, replicated) uses the same kernel, so they agree with
each other exactly. ``q_fp8=False`` keeps ``q`` as given (bf16 for the kernel: bf16 x bf16 dot of the exactly
converted codes): the reference model's formula.

**Tolerance.** The reference dequantizes the keys first (codes x scale, float32, as
:func:`dtkv.ops.dequantize_indexer_pages`) and computes in float32 (float64 when ``q`` is float64: the reference
model's path, bitwise its :func:`dtkv.decode.index_scores`); the kernel applies the key scale after the head sum
and sums in another order. Scores agree to float32 rounding (~1e-6 of the row's largest ``|score|`` under the
interpreter; fp8 tensor-core accumulation on Hopper adds ~2**-13 relative per dot): the positions and masks are
exact, and a selection differs only where two scores are that close.

**Bytes.** Per valid key ``J`` code bytes and 4 scale bytes are read once (8448 per 64-token page at ``J = 128``),
plus 8 bytes written per output column; queries and weights are ``N * I * (J * itemsize + 4)``. Padding pages and
non-causal keys are not read.

Legend: ``N`` queries, ``I`` indexer heads, ``J`` indexer dims, ``P`` local pages, ``S`` page size, ``L`` pages
read per query.
"""

from __future__ import annotations

import torch

from dtkv._checks import check_tensor
from dtkv._util import cdiv
from dtkv.layouts import IndexerFp8Layout

from ._common import INTERPRET, device_ctx, e4m3_bits, e4m3_blocks_torch, index_arg, resolve_backend, tl, triton

__all__ = ["KERNEL_CONFIG", "indexer_scores", "indexer_scores_bytes", "indexer_scores_torch"]

_INVALID_KEY = -(2**63)
_LOW32 = 2**32 - 1
_MAG31 = 0x7FFFFFFF
_Q_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_IDX_DTYPES = (torch.int32, torch.int64)


# ----------------------------------------------------------------------------------------- torch reference
def _pack_keys(scores_NS: torch.Tensor, pos_NS: torch.Tensor, valid_NS: torch.Tensor) -> torch.Tensor:
    """:func:`dtkv.decode.selection_keys` (restated here: ops sit below ``dtkv.decode``)."""
    s = scores_NS.to(torch.float32)
    s = torch.where(s == 0, torch.zeros_like(s), s)
    s = torch.where(torch.isnan(s), torch.full_like(s, float("nan")), s)
    bits = s.contiguous().view(torch.int32).to(torch.int64)
    ordered = torch.where(bits < 0, torch.bitwise_xor(bits, _MAG31), bits)
    keys = ordered * (2**32) + (_LOW32 - pos_NS.to(torch.int64))
    keep = valid_NS & (s != float("-inf"))
    return torch.where(keep, keys, torch.full_like(keys, _INVALID_KEY))


def indexer_scores_torch(
    q: torch.Tensor,  # [N, I, J] bf16/fp16/fp32/fp64
    w: torch.Tensor,  # [N, I] floating
    pool: torch.Tensor,  # uint8 [P, S*(J+4)]
    page_ids: torch.Tensor,  # [N, L] int32/int64, -1 padding
    page_slots: torch.Tensor,  # [N, L] int32/int64, -1 padding
    query_pos: torch.Tensor,  # [N] int32/int64
    page_size: int,
    q_fp8: bool,
) -> torch.Tensor:
    """Reference of :func:`indexer_scores`: gather the pages, dequantize, score, mask, pack (int64 ``[N, L*S]``)."""
    n, _, hd = q.shape
    num_pages = page_ids.shape[1]
    ps = page_size
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    ids = page_ids.to(torch.int64)
    real = (ids >= 0) & (ids < pool.shape[0]) & (page_slots >= 0)
    if pool.shape[0] == 0 or num_pages == 0:  # no page stored or none read: every slot is padding
        keys_NSJ = torch.zeros((n, num_pages * ps, hd), dtype=dtype, device=q.device)
    else:
        pages = pool[torch.where(real, ids, torch.zeros_like(ids))].reshape(n * num_pages, pool.shape[1])
        codes = pages[:, : ps * hd].contiguous().view(torch.float8_e4m3fn).float().view(-1, ps, hd)
        scales = pages[:, ps * hd :].contiguous().view(torch.float32).view(-1, ps, 1)
        keys_NSJ = (codes * scales).reshape(n, num_pages * ps, hd).to(dtype)
    if q_fp8:
        codes_q, scale_q = e4m3_blocks_torch(q.float())
        qx = codes_q.view(torch.float8_e4m3fn).to(dtype)
        wx = w.to(dtype) * scale_q.to(dtype)
    else:
        qx, wx = q.to(dtype), w.to(dtype)
    scores = (torch.relu(torch.einsum("nij,nsj->nis", qx, keys_NSJ)) * wx[:, :, None]).sum(1)
    offsets = torch.arange(ps, device=q.device)
    pos = (page_slots.to(torch.int64)[:, :, None] * ps + offsets).reshape(n, -1)
    valid = real[:, :, None].expand(-1, -1, ps).reshape(n, -1) & (pos <= query_pos.to(torch.int64)[:, None])
    return _pack_keys(scores, pos, valid)


# ----------------------------------------------------------------------------------------- Triton kernel
@triton.jit
def _indexer_scores_kernel(
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
    ci = tl.arange(0, NHP)
    cj = tl.arange(0, JP)
    qm = (ci < NH)[:, None] & (cj < J)[None, :]
    w = tl.load(w_ptr + n * w_sn + ci, mask=ci < NH, other=0.0).to(tl.float32)
    if Q_FP8:
        qf = tl.load(q_ptr + n * q_sn + ci[:, None] * q_si + cj[None, :], mask=qm, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(qf), axis=1)
        pos_amax = amax > 0
        inv = tl.where(pos_amax, tl.math.div_rn(tl.zeros_like(amax) + 448.0, tl.where(pos_amax, amax, 1.0)), 1.0)
        w = w * tl.math.div_rn(amax, 448.0)  # the query's scale, folded into the head weight
        qt = tl.trans(e4m3_bits(qf * inv[:, None], PREROUND).to(tl.float8e4nv, bitcast=True))  # [JP, NHP]
    else:
        qt = tl.trans(tl.load(q_ptr + n * q_sn + ci[:, None] * q_si + cj[None, :], mask=qm, other=0.0))
        if PREROUND:  # the interpreter's bf16/fp16 dot is wrong: the same products (exact) in float32
            qt = qt.to(tl.float32)
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
        if not Q_FP8:
            kf = kf.to(qt.dtype)
        if IMPRECISE_ACC > 0:
            acc = tl.dot(kf, qt, max_num_imprecise_acc=IMPRECISE_ACC)  # [BLOCK_S, NHP] fp32
        else:
            acc = tl.dot(kf, qt)
        s = tl.sum(tl.maximum(acc, 0.0) * w[None, :], axis=1) * scale
        # the int64 selection key: ord32(score) * 2**32 + (2**32 - 1 - position); -0.0 -> +0.0, one NaN
        s = tl.where(s == 0.0, 0.0, s)
        s = tl.where(s != s, float("nan"), s)
        bits = s.to(tl.int32, bitcast=True)
        ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
        key = ordered * 4294967296 + (4294967295 - pos)
        key = tl.where(valid & (s != float("-inf")), key, -9223372036854775808)
        tl.store(row_keys + col, key, mask=inside)


KERNEL_CONFIG: dict[str, int] = {"block_s": 64, "num_warps": 4, "num_stages": 4, "programs": 1056, "imprecise": 0}
"""Launch parameters: key columns per tile, warps, pipeline stages, the grid's target program count (tiles per
program grow to keep the grid near it), and ``max_num_imprecise_acc`` of the fp8 dot (0: Triton's default). Fixed,
never chosen per shape: every call scores a key with the same instructions, so sharded, full-view and replicated
steps get the same bits for the same key. ``benchmarks/bench_decode.py --indexer-sweep`` times alternatives on a
GPU."""


def _pow2_at_least(x: int, floor: int) -> int:
    return max(floor, 1 << max(0, x - 1).bit_length())


def _triton_takes(q: torch.Tensor, pool: torch.Tensor, page_size: int, q_fp8: bool) -> str:
    """Why the kernel cannot take these arguments ('' when it can)."""
    hd = q.shape[2]
    if q.dtype == torch.float64:
        return "q is float64 (the kernel computes in float32)"
    if not q_fp8 and q.dtype == torch.float32:
        return "q is float32 with q_fp8=False (the kernel's dot takes bf16/fp16 queries)"
    if (page_size * hd) % 4 or pool.stride(0) % 4 or pool.storage_offset() % 4:
        return (
            "the scales' byte offsets are not multiples of 4 (page_size * head_dim, the pool's page stride and "
            f"offset must be), got page_size={page_size}, head_dim={hd}, pool.stride()={pool.stride()}, "
            f"pool.storage_offset()={pool.storage_offset()}"
        )
    return ""


def _launch(keys, q, w, pool, page_ids, page_slots, query_pos, page_size: int, q_fp8: bool) -> None:
    n, heads, hd = q.shape
    num_pages = page_ids.shape[1]
    cols = num_pages * page_size
    cfg = KERNEL_CONFIG
    block_s = cfg["block_s"]
    tiles = cdiv(cols, block_s)
    per_prog = max(1, cdiv(tiles * n, max(1, cfg["programs"])))
    q = q if q.stride(2) == 1 else q.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    with device_ctx(q.device):
        _indexer_scores_kernel[(n, cdiv(tiles, per_prog))](
            keys, q, w, pool, page_ids, page_slots, query_pos,
            cols, num_pages, pool.shape[0], pool.stride(0), q.stride(0), q.stride(1), w.stride(0), per_prog,
            S=page_size, NH=heads, NHP=_pow2_at_least(heads, 16), J=hd, JP=_pow2_at_least(hd, 32), BLOCK_S=block_s,
            Q_FP8=q_fp8, PREROUND=INTERPRET, IMPRECISE_ACC=cfg["imprecise"],
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )  # fmt: skip


def _check(q, w, pool, page_ids, page_slots, query_pos, page_size) -> None:
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got page_size={page_size}")
    check_tensor("q", q, dtype=_Q_DTYPES, ndim=3)
    n, heads, hd = q.shape
    dev = q.device
    check_tensor("w", w, dtype=_Q_DTYPES, shape=(n, heads), device=dev)
    check_tensor("pool", pool, dtype=torch.uint8, shape=(None, page_size * (hd + 4)), device=dev)
    if pool.shape[0] and pool.stride(1) != 1:
        raise ValueError(f"pool pages must be contiguous (stride 1 in dim 1), got pool.stride()={pool.stride()}")
    check_tensor("page_ids", page_ids, dtype=_IDX_DTYPES, ndim=2, device=dev)
    if page_ids.shape[0] != n:
        raise ValueError(f"page_ids must have one row per query ({n}), got page_ids.shape={list(page_ids.shape)}")
    check_tensor("page_slots", page_slots, dtype=_IDX_DTYPES, shape=tuple(page_ids.shape), device=dev)
    check_tensor("query_pos", query_pos, dtype=_IDX_DTYPES, shape=(n,), device=dev)


# ----------------------------------------------------------------------------------------- registered op
@torch.library.custom_op("dtkv::indexer_scores", mutates_args=())
def _indexer_scores_op(
    q: torch.Tensor,
    w: torch.Tensor,
    pool: torch.Tensor,
    page_ids: torch.Tensor,
    page_slots: torch.Tensor,
    query_pos: torch.Tensor,
    page_size: int,
    q_fp8: bool,
    backend: str,
) -> torch.Tensor:
    _check(q, w, pool, page_ids, page_slots, query_pos, page_size)
    ids, slots, qpos = index_arg(page_ids), index_arg(page_slots), index_arg(query_pos)
    if backend != "triton":
        return indexer_scores_torch(q, w, pool, ids, slots, qpos, page_size, q_fp8)
    why = _triton_takes(q, pool, page_size, q_fp8)
    if why:
        raise NotImplementedError(f"backend='triton' for indexer_scores cannot run: {why}; use backend='torch'")
    keys = torch.empty((q.shape[0], ids.shape[1] * page_size), dtype=torch.int64, device=q.device)
    if keys.numel():
        _launch(keys, q, w, pool, ids, slots, qpos, page_size, q_fp8)
    return keys


@_indexer_scores_op.register_fake
def _fake_indexer_scores(q, w, pool, page_ids, page_slots, query_pos, page_size, q_fp8, backend):
    _check(q, w, pool, page_ids, page_slots, query_pos, page_size)
    return q.new_empty((q.shape[0], page_ids.shape[1] * page_size), dtype=torch.int64)


# ----------------------------------------------------------------------------------------- public wrapper
def indexer_scores(
    q: torch.Tensor,
    w: torch.Tensor,
    pool: torch.Tensor,
    page_ids: torch.Tensor,
    page_slots: torch.Tensor,
    query_pos: torch.Tensor,
    *,
    layout: IndexerFp8Layout,
    q_fp8: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """Indexer scores of each query over its pages, packed as selection keys (see the module docstring).

    Run phase: no host synchronization, no data-dependent shapes (CUDA-graph safe).

    Args:
        q: indexer queries ``[N, I, layout.head_dim]`` (bf16/fp16/fp32; float64 on the torch backend), last dim
            contiguous.
        w: head weights ``[N, I]``, floating.
        pool: this rank's indexer pages of one layer, uint8 ``[P, layout.page_size * (layout.head_dim + 4)]``
            (pages contiguous, any page stride).
        page_ids: int32/int64 ``[N, L]`` the local page each query reads in column ``l``; ``-1`` (or ``>= P``)
            is padding.
        page_slots: int32/int64 ``[N, L]`` the request's logical page index of each (its first token is at
            position ``page_slots * page_size``); ``-1`` is padding.
        query_pos: int32/int64 ``[N]`` position of each query: keys after it are masked (``-1``: all masked).
        layout: the pool's layout.
        q_fp8: quantize ``q`` per (query, head) to e4m3 first (the fast path; see the module docstring).
        backend: ``"auto"`` (Triton on CUDA where the kernel takes the arguments, else torch) | ``"torch"`` |
            ``"triton"``.

    Returns:
        int64 ``[N, L * page_size]`` selection keys (``INVALID_KEY`` where masked); column ``l * S + t`` is token
        ``t`` of page ``l``.

    Raises:
        TypeError / ValueError: bad dtypes or shapes, naming the argument.
        NotImplementedError: ``backend="triton"`` with arguments the kernel does not take (float64 ``q``,
            misaligned scales).
    """
    if not isinstance(layout, IndexerFp8Layout):
        raise TypeError(f"layout must be a dtkv.IndexerFp8Layout, got {type(layout).__name__}")
    if isinstance(q, torch.Tensor) and q.dim() == 3 and q.shape[2] != layout.head_dim:
        raise ValueError(f"q must have shape [*, *, {layout.head_dim}] (layout.head_dim), got {list(q.shape)}")
    be = resolve_backend(backend, q.device)
    if be == "triton" and backend == "auto" and _triton_takes(q, pool, layout.page_size, q_fp8):
        be = "torch"
    return torch.ops.dtkv.indexer_scores(q, w, pool, page_ids, page_slots, query_pos, layout.page_size, q_fp8, be)


def indexer_scores_bytes(*, num_valid_keys: int, num_cols: int, num_queries: int, heads: int, head_dim: int) -> int:
    """HBM bytes one call must move: the valid keys' codes and scales, the output keys, queries and weights
    (bf16 queries): what the GB/s of a benchmark is computed from."""
    return num_valid_keys * (head_dim + 4) + num_cols * 8 + num_queries * heads * (head_dim * 2 + 4)
