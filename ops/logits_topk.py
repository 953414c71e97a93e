"""``dtkv::logits_topk``: the ``k`` best key columns of each query's float32 indexer logits, best first, ties to the
lowest column, in one kernel and without int64 selection keys over the whole ``[N, K]``.

Entry point: :func:`logits_topk`; reference :func:`logits_topk_torch`. What it computes is, bit for bit,
:func:`dtkv.ops.indexer_topk` of :func:`dtkv.ops.selection_keys.selection_keys` of the logits with the columns as
positions (the extend-step indexer's tie rule, :mod:`dtkv.integrations.transformers`):

- the candidates of row ``n`` are its columns ``key_start[n] <= c < key_end[n]`` (every column without the range)
  whose logit is not ``-inf``;
- a higher float32 logit comes first (``-0.0`` equals ``+0.0``, every NaN is one value above ``+inf``), equal
  logits come by lower column;
- the result is ``[N, k]`` int64: the ``k`` best candidates (``key_slots[c]`` with ``key_slots``, else ``c``), best
  first, ``-1`` past the row's candidates.

**Kernel** (one program a row; passes over the row's range only, so a query of one request never reads the
columns of another): each logit's *order key* ``u`` is an int64 in ``[0, 2**32)`` that orders like the rule
(:func:`_order_key`). A row with at most ``k`` columns in range keeps every candidate (one pass). Otherwise:

1. the largest order key and the number of candidates (a row with at most ``k`` of them keeps them all);
2. a 256-bin histogram of ``(u >> COARSE) - base``, the coarse window of the 256 steps below the largest key's
   (``2**COARSE`` order keys a step: ``COARSE = 18`` is 1/32 of an octave; keys further below share bin 0): the bin
   holding the ``k``-th best, the keys above it (fewer than ``k``), those in it (``cand``). While ``cand`` exceeds
   ``CAP`` and bits are left, a histogram of the next 8 bits among the keys of that prefix narrows it (a radix
   select; a ``k``-th best in bin 0 restarts it from the top bit; with every bit known the bin holds exact ties);
3. the keys above the prefix go to the front of a scratch row as int64 selection keys, those at it after them --
   all of them (at most ``CAP``), or with every bit known the ``need`` lowest columns; of the former the ``need``
   best are kept (one ``tl.sort`` of ``CAP``); the ``k`` selected are sorted (``tl.sort`` of ``KP``, bitonic) and
   decoded.

Typical logits take passes 1, 2 and 3 (three reads of the row); ties at the ``k``-th best (many equal logits) add a
histogram pass per 8 bits. Launch: :data:`KERNEL_CONFIG` (``block``: columns a step, ``num_warps``, ``cap``,
``coarse``); ``benchmarks/bench_logits_topk.py`` times it against ``torch.topk``.

Legend: ``N`` queries (rows), ``K`` key columns, ``k`` kept per row (``KP``: the next power of two), ``CAP`` the
largest threshold bin gathered (scratch rows of ``KP + CAP`` columns).
"""

from __future__ import annotations

import torch

from dtkv._checks import check_int, check_tensor

from ._common import device_ctx, index_arg, resolve_backend, tl, triton
from .indexer_logits import indexer_topk
from .selection_keys import selection_keys

__all__ = ["KERNEL_CONFIG", "logits_topk", "logits_topk_torch", "scratch_columns"]

_IDX_DTYPES = (torch.int32, torch.int64)
_REF_BLOCK_BYTES = 1 << 28
"""The reference's ``[B, K]`` int64 keys per block of rows (bounded whatever ``N``)."""

KERNEL_CONFIG: dict[str, int] = {"block": 1024, "num_warps": 8, "cap": 0, "coarse": 18, "num_stages": 2}
"""Launch of the kernel: ``block`` columns a step of each pass, ``num_warps``, ``num_stages`` (of the passes'
loops), ``cap`` (the most keys of the
threshold's bin gathered without another histogram pass, a power of two; ``0``: ``KP // 2``), ``coarse`` (the
coarse window's shift: a bin is ``2**coarse`` order keys). The default builds for sm_90 in 114 registers a thread
(two programs an SM), the passes' loads pipelined (``cp.async``), without spills (``benchmarks/compile_ops.py
--sass``); not timed yet."""


# ----------------------------------------------------------------------------------------- torch reference
def logits_topk_torch(
    logits: torch.Tensor,  # [N, K] float32
    k: int,
    key_start: torch.Tensor | None,  # [N] int
    key_end: torch.Tensor | None,  # [N] int
    key_slots: torch.Tensor | None,  # [K] int
) -> torch.Tensor:
    """Reference of :func:`logits_topk`: :func:`selection_keys` of each block of rows (columns as positions, the
    range as visibility), :func:`indexer_topk`, the columns mapped through ``key_slots`` (at most
    :data:`_REF_BLOCK_BYTES` of keys at a time)."""
    n, num_keys = logits.shape
    dev = logits.device
    out = torch.full((n, k), -1, dtype=torch.int64, device=dev)
    cols = torch.arange(num_keys, device=dev)
    block = max(1, _REF_BLOCK_BYTES // max(1, 8 * num_keys))
    for b0 in range(0, n, block):
        b1 = min(n, b0 + block)
        visible = None
        if key_start is not None and key_end is not None:
            lo, hi = key_start[b0:b1, None].to(torch.int64), key_end[b0:b1, None].to(torch.int64)
            visible = (cols[None, :] >= lo) & (cols[None, :] < hi)
        keys = selection_keys(logits[b0:b1], cols[None, :], visible)
        top, valid = indexer_topk(keys, k)
        if key_slots is not None:
            top = torch.where(valid, key_slots.to(torch.int64)[top.clamp(min=0)], torch.full_like(top, -1))
        out[b0:b1] = top
    return out


# ----------------------------------------------------------------------------------------- Triton kernel
@triton.jit
def _order_key(s):
    """float32 logits -> uint32 order keys: ``ord32(s) + 2**31``, the score field of
    :func:`dtkv.ops.selection_keys.pack_selection_key` made unsigned (``-0.0`` as ``+0.0``, one NaN above
    ``+inf``)."""
    s = tl.where(s == 0.0, 0.0, s)
    s = tl.where(s != s, float("nan"), s)
    bits = s.to(tl.int32, bitcast=True)
    return (tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits) ^ -2147483648).to(tl.uint32, bitcast=True)


@triton.jit
def _top_bits(u, shift):
    """``u >> shift`` for a shift in ``[0, 32]`` (a shift by 32 is 0, not undefined)."""
    return tl.where(shift >= 32, 0, u >> tl.minimum(shift, 31).to(tl.uint32))


@triton.jit
def _row_keys(src, c0, lo, hi, BLOCK: tl.constexpr):
    """One step of a pass: int32 columns ``[c0, c0 + BLOCK)``, their order keys and which are candidates (in
    ``[lo, hi)``, not ``-inf``)."""
    cols = c0 + tl.arange(0, BLOCK)
    s = tl.load(src + cols, mask=(cols >= lo) & (cols < hi), other=float("-inf"))
    return cols, _order_key(s), s != float("-inf")


@triton.jit
def _threshold_bin(hist, need):
    """The bin of a 256-bin histogram that holds the ``need``-th largest key (``need <= hist.sum()``): ``(bin, keys
    in higher bins, keys in it)``, int32."""
    bins = tl.arange(0, 256)
    at_or_above = tl.sum(hist, axis=0) - (tl.cumsum(hist, axis=0) - hist)  # keys in bins >= b (non-increasing)
    b = tl.sum((at_or_above >= need).to(tl.int32), axis=0) - 1
    above = tl.sum(tl.where(bins > b, hist, 0), axis=0)
    cand = tl.sum(tl.where(bins == b, hist, 0), axis=0)
    return b, above, cand


@triton.jit
def _keep_best(seg, count, need, SIZE: tl.constexpr):
    """The ``need`` best of the ``count`` (``<= SIZE``) selection keys at ``seg``, written back at ``seg`` (any
    order)."""
    j = tl.arange(0, SIZE)
    key = tl.sort(tl.load(seg + j, mask=j < count, other=-9223372036854775808), dim=0, descending=True)
    tl.debug_barrier()  # every thread has read its keys before any is overwritten
    tl.store(seg + j, key, mask=j < need)


@triton.jit
def _sort_and_emit(sel, count, out_row, k, slots_ptr, HAS_SLOTS: tl.constexpr, SIZE: tl.constexpr):
    """Sort the ``count`` (``<= k <= SIZE``) selection keys at ``sel``, best first, and store them as columns or
    slots, ``-1`` up to ``k``."""
    j = tl.arange(0, SIZE)
    key = tl.sort(tl.load(sel + j, mask=j < count, other=-9223372036854775808), dim=0, descending=True)
    valid = key != -9223372036854775808
    col = 4294967295 - (key & 4294967295)
    keep = j < k
    if HAS_SLOTS:
        val = tl.load(slots_ptr + col, mask=valid & keep, other=-1).to(tl.int64)
    else:
        val = col
    tl.store(out_row + j, tl.where(valid, val, -1), mask=keep)


@triton.jit(do_not_specialize=["num_keys", "k"])
def _logits_topk_kernel(
    out_ptr,  # [N, k] int64, contiguous
    scratch_ptr,  # [N, KP + CAP] int64, contiguous: each row's selection keys before the sort
    logits_ptr,  # [N, K] float32; row stride l_sn, columns contiguous
    start_ptr,  # [N] int32/int64, contiguous (HAS_RANGE): first column in range
    end_ptr,  # [N] int32/int64, contiguous (HAS_RANGE): one past the last
    slots_ptr,  # [K] int32/int64, contiguous (HAS_SLOTS): what each column maps to
    num_keys,  # K (< 2**31)
    k,
    l_sn,
    HAS_RANGE: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
    BLOCK: tl.constexpr,
    KP: tl.constexpr,
    CAP: tl.constexpr,
    COARSE: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """Program ``n``: row ``n`` (module docstring's passes). Columns, counts and order keys are 32-bit."""
    row = tl.program_id(0).to(tl.int64)
    lo = num_keys * 0
    hi = lo + num_keys
    if HAS_RANGE:
        lo = tl.minimum(tl.maximum(tl.load(start_ptr + row), 0), num_keys).to(tl.int32)
        hi = tl.maximum(tl.minimum(tl.load(end_ptr + row), num_keys).to(tl.int32), lo)
    first = lo // BLOCK * BLOCK
    src = logits_ptr + row * l_sn
    zero = lo * 0
    # the selection: candidates whose key has (u >> shift) above prefix (k - need of them), and `need` of those at
    # prefix -- the best (all of them while shift > 0, sorted after), the lowest columns once shift == 0 (exact
    # ties); shift 32 with prefix 0 and need k: every candidate (at most k)
    shift = zero + 32
    prefix = zero.to(tl.uint32)
    need = zero + k
    if hi - lo > k:
        umax = zero.to(tl.uint32)
        count = zero
        for c0 in tl.range(first, hi, BLOCK, num_stages=NUM_STAGES):  # pass 1: the largest key, the candidates
            cols, u, ok = _row_keys(src, c0, lo, hi, BLOCK)
            umax = tl.maximum(umax, tl.max(tl.where(ok, u, 0), axis=0))
            count += tl.sum(ok.to(tl.int32), axis=0)
        if count > k:
            base = tl.maximum((umax >> COARSE).to(tl.int32) - 255, 0)
            hist = tl.zeros([256], dtype=tl.int32)
            for c0 in tl.range(first, hi, BLOCK, num_stages=NUM_STAGES):  # pass 2: the coarse window below the max
                cols, u, ok = _row_keys(src, c0, lo, hi, BLOCK)
                d = tl.minimum(tl.maximum((u >> COARSE).to(tl.int32) - base, 0), 255)
                hist += tl.histogram(d, 256, mask=ok)
            b, above, cand = _threshold_bin(hist, need)
            if (b > 0) | (base == 0):  # bin b is the keys with (u >> COARSE) == base + b
                shift = zero + COARSE
                prefix = (base + b).to(tl.uint32)
                need = need - above
            else:  # bin 0 also holds every key further below: the radix select starts at the top bit
                cand = count
            while (cand > CAP) & (shift > 0):  # 8 more bits among the keys at the prefix
                width = tl.minimum(shift, 8)
                nshift = shift - width
                digit = ((1 << width) - 1).to(tl.uint32)
                hist = tl.zeros([256], dtype=tl.int32)
                for c0 in tl.range(first, hi, BLOCK, num_stages=NUM_STAGES):
                    cols, u, ok = _row_keys(src, c0, lo, hi, BLOCK)
                    d = ((u >> nshift.to(tl.uint32)) & digit).to(tl.int32)
                    hist += tl.histogram(d, 256, mask=ok & (_top_bits(u, shift) == prefix))
                b, above, cand = _threshold_bin(hist, need)
                need = need - above
                prefix = (prefix << width.to(tl.uint32)) | b.to(tl.uint32)
                shift = nshift
    # pass 3: the keys above the prefix to the scratch row's front, those at it after them (column order)
    sel = scratch_ptr + row * (KP + CAP)
    num_above = k - need
    limit = tl.where(shift == 0, need, 2147483647)
    seen = zero
    put = zero
    for c0 in tl.range(first, hi, BLOCK, num_stages=NUM_STAGES):
        cols, u, ok = _row_keys(src, c0, lo, hi, BLOCK)
        top = _top_bits(u, shift)
        gt = ok & (top > prefix)
        at = ok & (top == prefix)
        g = gt.to(tl.int32)
        a = at.to(tl.int32)
        rank = seen + tl.cumsum(a, axis=0) - a
        ordered = (u ^ 2147483648).to(tl.int32, bitcast=True).to(tl.int64)
        key = ordered * 4294967296 + (4294967295 - cols.to(tl.int64))
        tl.store(sel + put + tl.cumsum(g, axis=0) - g, key, mask=gt)
        tl.store(sel + num_above + rank, key, mask=at & (rank < limit))
        put += tl.sum(g, axis=0)
        seen += tl.sum(a, axis=0)
    at_prefix = tl.minimum(seen, limit)
    tl.debug_barrier()  # the gathered keys are read back by other threads of the program
    if at_prefix > need:  # (shift > 0: at most CAP of them) keep the best `need`
        _keep_best(sel + num_above, at_prefix, need, CAP)
        tl.debug_barrier()
    _sort_and_emit(sel, num_above + tl.minimum(at_prefix, need), out_ptr + row * k, k, slots_ptr, HAS_SLOTS, KP)


# ----------------------------------------------------------------------------------------- launch
def _pow2_at_least(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def scratch_columns(k: int) -> tuple[int, int]:
    """``(KP, CAP)`` of a launch for ``k`` (:data:`KERNEL_CONFIG`'s ``cap``; both powers of two); its scratch rows
    have ``KP + CAP`` columns."""
    kp = _pow2_at_least(k)
    cap = _pow2_at_least(int(KERNEL_CONFIG["cap"]) or max(1, kp // 2))
    return kp, cap


def _launch(out, logits, start, end, slots, k: int) -> None:
    n, num_keys = logits.shape
    kp, cap = scratch_columns(k)
    scratch = torch.empty((n, kp + cap), dtype=torch.int64, device=logits.device)
    with device_ctx(logits.device):
        _logits_topk_kernel[(n,)](
            out, scratch, logits,
            out if start is None else start, out if end is None else end, out if slots is None else slots,
            num_keys, k, logits.stride(0),
            HAS_RANGE=start is not None, HAS_SLOTS=slots is not None, BLOCK=int(KERNEL_CONFIG["block"]), KP=kp,
            CAP=cap, COARSE=int(KERNEL_CONFIG["coarse"]), NUM_STAGES=int(KERNEL_CONFIG["num_stages"]),
            num_warps=int(KERNEL_CONFIG["num_warps"]),
        )  # fmt: skip


def _check(logits, key_start, key_end, key_slots, k) -> None:
    check_int("k", k, min_value=1)
    check_tensor("logits", logits, dtype=torch.float32, ndim=2)
    n, num_keys = logits.shape
    dev = logits.device
    if num_keys >= 2**31 - 1:  # a column is a selection key's position; the kernel counts columns in 32 bits
        raise ValueError(f"logits must have fewer than 2**31 - 1 columns, got {num_keys}")
    if (key_start is None) != (key_end is None):
        which = "key_start" if key_end is None else "key_end"
        raise ValueError(f"key_start and key_end go together (a column range per row), got only {which}")
    if key_start is not None:
        check_tensor("key_start", key_start, dtype=_IDX_DTYPES, shape=(n,), device=dev)
        check_tensor("key_end", key_end, dtype=_IDX_DTYPES, shape=(n,), device=dev)
    if key_slots is not None:
        check_tensor("key_slots", key_slots, dtype=_IDX_DTYPES, shape=(num_keys,), device=dev)


# ----------------------------------------------------------------------------------------- registered op
@torch.library.custom_op("dtkv::logits_topk", mutates_args=())
def _logits_topk_op(
    logits: torch.Tensor,
    key_start: torch.Tensor | None,
    key_end: torch.Tensor | None,
    key_slots: torch.Tensor | None,
    k: int,
    backend: str,
) -> torch.Tensor:
    _check(logits, key_start, key_end, key_slots, k)
    start = None if key_start is None else index_arg(key_start)
    end = None if key_end is None else index_arg(key_end)
    slots = None if key_slots is None else index_arg(key_slots)
    if backend != "triton":
        return logits_topk_torch(logits, k, start, end, slots)
    out = torch.empty((logits.shape[0], k), dtype=torch.int64, device=logits.device)
    if out.numel():
        src = logits if logits.stride(1) == 1 or logits.shape[1] <= 1 else logits.contiguous()
        _launch(out, src, start, end, slots, k)
    return out


@_logits_topk_op.register_fake
def _fake_logits_topk(logits, key_start, key_end, key_slots, k, backend):
    _check(logits, key_start, key_end, key_slots, k)
    return logits.new_empty((logits.shape[0], k), dtype=torch.int64)


# ----------------------------------------------------------------------------------------- public wrapper
def logits_topk(
    logits: torch.Tensor,
    k: int,
    *,
    key_start: torch.Tensor | None = None,
    key_end: torch.Tensor | None = None,
    key_slots: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """The ``k`` best candidates of each row of ``logits``, best first, ties to the lowest column (module
    docstring).

    Run phase: one launch (plus its scratch), no host synchronization, no data-dependent shapes.

    Args:
        logits: float32 ``[N, K]`` (e.g. :func:`dtkv.ops.indexer_logits`'s; ``-inf``: not a candidate).
        k: columns kept per row (``>= 1``; rows with fewer candidates are ``-1`` padded).
        key_start, key_end: int32/int64 ``[N]``, both or neither: row ``n``'s candidates lie in
            ``[key_start[n], key_end[n])`` (clamped to ``[0, K]``; columns outside are never read).
        key_slots: int32/int64 ``[K]``: return ``key_slots[c]`` instead of the column ``c``.
        backend: ``"auto"`` (Triton on CUDA, else torch) | ``"torch"`` | ``"triton"``.

    Returns:
        int64 ``[N, k]``: columns (or their ``key_slots``), ``-1`` past a row's candidates.

    Raises:
        TypeError / ValueError: bad dtypes, shapes or ``k``, naming the argument.
    """
    return torch.ops.dtkv.logits_topk(logits, key_start, key_end, key_slots, k, resolve_backend(backend, logits.device))
