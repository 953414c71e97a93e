"""``dtkv::logits_topk``: the ``k`` best key columns of each query's float32 indexer logits, best first, ties to the
lowest column, without int64 selection keys over the whole ``[N, K]``.

Entry point: :func:`logits_topk`; reference :func:`logits_topk_torch`. What it computes is, bit for bit,
:func:`dtkv.ops.indexer_topk` of :func:`dtkv.ops.selection_keys.selection_keys` of the logits with the columns as
positions (the extend-step indexer's tie rule, :mod:`dtkv.integrations.transformers`):

- the candidates of row ``n`` are its columns ``key_start[n] <= c < key_end[n]`` (every column without the range)
  whose logit is not ``-inf``;
- a higher float32 logit comes first (``-0.0`` equals ``+0.0``, every NaN is one value above ``+inf``), equal
  logits come by lower column;
- the result is ``[N, k]`` int64: the ``k`` best candidates (``key_slots[c]`` with ``key_slots``, else ``c``), best
  first, ``-1`` past the row's candidates.

**Kernel path** (``triton``): the packed path reads 8 bytes a logit in each of ``torch.topk``'s 8 radix passes over
64-bit keys; this one reads 4 bytes a logit in 4 passes and once more:

1. *the threshold*: ``torch.topk`` of the float32 rows (values only, unsorted; with ranges, of a copy that is
   ``-inf`` outside them -- the runtime's indexer logits already are, so it passes none);
2. *one launch, a program a row* (:func:`_logits_topk_select_kernel`): the smallest kept value under the rule's order
   (each logit's int32 *order key*, :func:`dtkv.ops.selection_keys.order_keys`) is the threshold ``t``, and the
   kept values above it say how many of the row's keys at ``t`` belong in (``need``); one read of the row then
   writes the candidates above ``t`` and the ``need`` lowest-column candidates at ``t`` to ``[N, k]`` scratch rows,
   in column order: their order keys (int32) and their columns (int32), ``-2**31`` / ``-1`` after them.
   ``torch.topk`` may break ties of equal values (or of ``-0.0`` and ``+0.0``) its own way: the rule only needs its
   kept values to hold every candidate above their smallest, which any top-k does;
3. a stable ``torch.sort`` of the order keys, descending (equal keys stay in column order: best first, ties to
   the lowest column), the columns gathered in that order, then mapped to their slots.

Launch: :data:`KERNEL_CONFIG`; ``benchmarks/bench_logits_topk.py`` times it against the packed path (one H100,
8192 queries x 8K-128K keys: 1.26-1.55x its speed, 2026-12-06). At decode's few rows a program a row is slower
than the packed path, which the runtime's decode keeps.

**Rows of many keys** (the grouped bound; ``K >= 2 * ratio * k`` and ``N >= min_rows``, :data:`GROUP_CONFIG`,
:func:`group_size`): step
1's ``torch.topk`` over the whole row is most of the path's time. Cut the row into groups of ``G`` columns instead:

1. one launch (:func:`_group_max_kernel`) writes each group's largest order key, ``[N, K / G]`` int32;
2. ``torch.topk`` of those finds the ``k``-th largest group maximum, the row's *bound*: ``k`` groups hold a key at
   or above it, so the row's ``k`` best (and every key tied with the ``k``-th) are at or above it too;
3. one launch, a program a row (:func:`_candidates_kernel`), lists the groups whose maximum reaches the bound (a
   scan of ``K / G`` keys) and copies only their candidates at or above it, in column order, to ``[N, cap * k]``
   rows (values and columns; ``-inf`` / ``-1`` after them) -- about ``1.1 k`` of them a row when the logits are not
   clustered;
4. a row with more than ``cap * k`` candidates at its bound (many exact ties; high logits in runs of
   neighbouring columns) *overflows*: one launch, a program a row (:func:`_overflow_rows_kernel`, whose other
   programs return at once) finds its exact ``k``-th best key by a radix select over the whole row (four rounds of
   8-bit digits) and writes its ``k`` best, in column order, over its candidates' row;
5. steps 1-3 above over those rows (their columns are in order: ties still go to the lowest column), the
   positions mapped back to columns.

No host read, no data-dependent shape: the result is the exact path's, bit for bit, whichever rows overflow.

Legend: ``N`` queries (rows), ``K`` key columns, ``k`` kept per row.
"""

from __future__ import annotations

import torch

from dtkv._checks import check_int, check_tensor

from ._common import HIST_HAS_MASK, device_ctx, index_arg, masked_histogram, resolve_backend, tl, triton
from .indexer_logits import indexer_topk
from .selection_keys import order_key, selection_keys

__all__ = ["GROUP_CONFIG", "KERNEL_CONFIG", "group_size", "logits_topk", "logits_topk_torch"]

_IDX_DTYPES = (torch.int32, torch.int64)
_REF_BLOCK_BYTES = 1 << 28
"""The reference's ``[B, K]`` int64 keys per block of rows (bounded whatever ``N``)."""

KERNEL_CONFIG: dict[str, int] = {"block": 1024, "num_warps": 4, "num_stages": 2}
"""Launch of :func:`_logits_topk_select_kernel`: ``block`` columns a step of its one pass over a row (and of its
passes over the kept values; a power of two below ``2**15``), ``num_warps``, ``num_stages`` (loads of the pass in
flight). On one H100 the default is within 2% of the fastest of ``bench_logits_topk.py --sweep``'s ten launches at
8192 queries x 32K and 128K keys (2026-12-06)."""

GROUP_CONFIG: dict[str, int] = {
    "ratio": 4, "max_group": 32, "cap": 2, "min_rows": 128, "group_block": 1024, "scan_block": 1024,
}  # fmt: skip
"""The grouped bound (module docstring, *rows of many keys*): a row of ``K`` columns is cut into groups of ``G``
columns, ``G`` the largest power of two up to ``max_group`` with ``K // G >= ratio * k`` (none below 2, or fewer
than ``min_rows`` rows: the exact path, faster at decode's few rows); ``cap * k`` candidates a row at most (rows
past it overflow); ``group_block`` groups a step of the group scan, ``scan_block`` columns a step of the
candidates' scan (powers of two)."""


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
@triton.jit(do_not_specialize=["num_keys", "k", "kk"])
def _logits_topk_select_kernel(
    ord_ptr,  # [N, k] int32, contiguous: the kept keys' order keys, column order, -2**31 after them
    col_ptr,  # [N, k] int32, contiguous: their columns, -1 after them
    logits_ptr,  # [N, K] float32; row stride l_sn, columns contiguous (-inf outside each row's range)
    kept_ptr,  # [N, kk] float32, contiguous: the values torch.topk kept of each row
    num_keys,  # K (< 2**31)
    k,
    kk,  # min(k, K)
    l_sn,
    BLOCK: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """Program ``n``: row ``n`` (the module docstring's step 2). Columns, counts and order keys are 32-bit."""
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)
    zero = num_keys * 0
    # the threshold: the smallest kept order key; `need`: how many keys at it are kept (kk - those above it)
    t = zero + 2147483647
    for c0 in range(0, kk, BLOCK):
        u = order_key(tl.load(kept_ptr + row * kk + c0 + j, mask=c0 + j < kk, other=float("inf")))
        t = tl.minimum(t, tl.min(tl.where(c0 + j < kk, u, 2147483647), axis=0))
    above = zero
    for c0 in range(0, kk, BLOCK):
        u = order_key(tl.load(kept_ptr + row * kk + c0 + j, mask=c0 + j < kk, other=float("-inf")))
        above += tl.sum((u > t).to(tl.int32), axis=0)
    need = kk - above
    # one read of the row: the keys above t, and the `need` lowest-column keys at t, in column order. One scan a
    # step counts both kinds (keys above t in the low 16 bits, keys at t in the high ones: BLOCK < 2**15)
    src = logits_ptr + row * l_sn
    put = zero
    seen = zero  # keys at t before this step
    for c0 in tl.range(0, num_keys, BLOCK, num_stages=NUM_STAGES):
        cols = c0 + j
        u = order_key(tl.load(src + cols, mask=cols < num_keys, other=float("-inf")))
        ok = u != -2147483648
        gt = ok & (u > t)
        at = ok & (u == t)
        both = gt.to(tl.int32) + (at.to(tl.int32) << 16)
        before = tl.cumsum(both, axis=0) - both
        at_before = seen + (before >> 16)
        # kept before this key: those above t, and those at t up to `need`
        pos = row * k + put + (before & 0xFFFF) + tl.minimum(at_before, need) - tl.minimum(seen, need)
        take = gt | (at & (at_before < need))
        tl.store(ord_ptr + pos, u, mask=take)
        tl.store(col_ptr + pos, cols, mask=take)
        total = tl.sum(both, axis=0)
        put += (total & 0xFFFF) + tl.minimum(seen + (total >> 16), need) - tl.minimum(seen, need)
        seen += total >> 16
    for c0 in range(0, k, BLOCK):  # the rest of the row: padding
        pad = (c0 + j < k) & (c0 + j >= put)
        tl.store(ord_ptr + row * k + c0 + j, tl.full([BLOCK], -2147483648, tl.int32), mask=pad)
        tl.store(col_ptr + row * k + c0 + j, tl.full([BLOCK], -1, tl.int32), mask=pad)


@triton.jit(do_not_specialize=["num_keys", "num_groups", "l_sn"])
def _group_max_kernel(
    gmax_ptr,  # [N, num_groups] int32, contiguous: each group's largest order key (-2**31: no candidate)
    logits_ptr,  # [N, K] float32; row stride l_sn, columns contiguous
    num_keys,
    num_groups,  # cdiv(K, G)
    l_sn,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    """Program ``(n, b)``: groups ``b * BLOCK_G ...`` of row ``n``, ``G`` columns each."""
    row = tl.program_id(0).to(tl.int64)
    grp = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    cols = grp[:, None] * G + tl.arange(0, G)[None, :]
    u = order_key(tl.load(logits_ptr + row * l_sn + cols, mask=cols < num_keys, other=float("-inf")))
    tl.store(gmax_ptr + row * num_groups + grp, tl.max(u, axis=1), mask=grp < num_groups)


@triton.jit(do_not_specialize=["num_keys", "num_groups", "cap", "l_sn"])
def _candidates_kernel(
    val_ptr,  # [N, cap] float32, contiguous: the candidates at or above the bound, column order, -inf after them
    col_ptr,  # [N, cap] int32, contiguous: their columns, -1 after them
    count_ptr,  # [N] int32: how many candidates the row has at or above the bound (cap + 1: more than cap)
    gid_ptr,  # [N, cap] int32 scratch: the groups the row keeps, in order
    logits_ptr,  # [N, K] float32; row stride l_sn, columns contiguous
    gmax_ptr,  # [N, num_groups] int32 (_group_max_kernel)
    bound_ptr,  # [N] int32: the row's bound, an order key
    num_keys,
    num_groups,
    cap,
    l_sn,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_S: tl.constexpr,  # groups a step of the candidates' scan (BLOCK_S * G columns)
):
    """Program ``n``: the candidates of row ``n`` at or above its bound (the module docstring's grouped step 3):
    a scan of the group maxima lists the groups that can hold one, then only those groups' columns are read."""
    row = tl.program_id(0).to(tl.int64)
    zero = num_keys * 0
    t = tl.load(bound_ptr + row)
    # the groups with a candidate at or above t, in order (each holds one: more than cap of them overflow)
    jg = tl.arange(0, BLOCK_G)
    kept = zero
    for g0 in range(0, num_groups, BLOCK_G):
        grp = g0 + jg
        m = tl.load(gmax_ptr + row * num_groups + grp, mask=grp < num_groups, other=-2147483648)
        s = ((m >= t) & (m != -2147483648)).to(tl.int32)
        pos = kept + tl.cumsum(s, axis=0) - s
        tl.store(gid_ptr + row * cap + pos, grp, mask=(s != 0) & (pos < cap))
        kept += tl.sum(s, axis=0)
    listed = tl.where(kept > cap, 0, kept)  # past cap the row overflows: the exact path takes it
    # their candidates at or above t, in column order
    js = tl.arange(0, BLOCK_S)
    jc = tl.arange(0, G)
    put = zero
    for s0 in range(0, listed, BLOCK_S):
        live = s0 + js < listed
        grp = tl.load(gid_ptr + row * cap + s0 + js, mask=live, other=0)
        cols = grp[:, None] * G + jc[None, :]
        ok = live[:, None] & (cols < num_keys)
        x = tl.load(logits_ptr + row * l_sn + cols, mask=ok, other=float("-inf"))
        u = order_key(x)
        c = tl.reshape(((u >= t) & (u != -2147483648) & ok).to(tl.int32), [BLOCK_S * G])
        xs = tl.reshape(x, [BLOCK_S * G])
        cs = tl.reshape(cols, [BLOCK_S * G])
        pos = put + tl.cumsum(c, axis=0) - c
        take = (c != 0) & (pos < cap)
        tl.store(val_ptr + row * cap + pos, xs, mask=take)
        tl.store(col_ptr + row * cap + pos, cs, mask=take)
        put += tl.sum(c, axis=0)
    tl.store(count_ptr + row, tl.where(kept > cap, cap + 1, tl.minimum(put, cap + 1)))
    jp = tl.arange(0, BLOCK_G)
    for c0 in range(0, cap, BLOCK_G):  # the rest of the row: padding
        pad = (c0 + jp < cap) & (c0 + jp >= put)
        tl.store(val_ptr + row * cap + c0 + jp, tl.full([BLOCK_G], float("-inf"), tl.float32), mask=pad)
        tl.store(col_ptr + row * cap + c0 + jp, tl.full([BLOCK_G], -1, tl.int32), mask=pad)


@triton.jit
def _descend(h, prefix, rem, SHIFT: tl.constexpr):
    """From a round's histogram ``h`` (256 bins of digit ``[SHIFT, SHIFT + 8)`` of the keys sharing ``prefix``'s
    bits above it): the prefix with the digit where the count of keys from the top reaches ``rem``, how many keys
    with that prefix are still needed, and whether that is all of them (int32 1/0)."""
    b = tl.arange(0, 256)
    above = tl.sum(h, axis=0) - tl.cumsum(h, axis=0)  # keys in bins above b
    d = tl.max(tl.where((above < rem) & (above + h >= rem), b, -1), axis=0)
    rem = rem - tl.sum(tl.where(b == d, above, 0), axis=0)
    done = (tl.sum(tl.where(b == d, h, 0), axis=0) == rem).to(tl.int32)
    raw = d
    if SHIFT == 24:  # the top digit's sign bit is flipped (key order)
        raw = d ^ 0x80
    return prefix | (raw << SHIFT), rem, done


@triton.jit(do_not_specialize=["num_keys", "k", "cap", "l_sn"])
def _overflow_rows_kernel(
    val_ptr,  # [N, cap] float32, contiguous (_candidates_kernel's): an overflowing row's k best, column order
    col_ptr,  # [N, cap] int32, contiguous: their columns, -1 after them
    count_ptr,  # [N] int32 (_candidates_kernel's): past cap, the row overflowed
    logits_ptr,  # [N, K] float32; row stride l_sn, columns contiguous
    num_keys,
    k,
    cap,
    l_sn,
    BLOCK: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    HIST_MASK: tl.constexpr,
):
    """Program ``n``: nothing, unless row ``n`` overflowed; then its exact ``k`` best, in column order, over its
    candidates' row (the module docstring's grouped step 4): a radix select of the ``k``-th best order key ``t`` in
    four rounds of 8-bit digits (``tl.histogram``; a row is resolved once every key with the chosen prefix is
    needed), then one read of the row that writes the keys above ``t`` and the lowest-column ones at ``t``."""
    row = tl.program_id(0).to(tl.int64)
    if tl.load(count_ptr + row) > cap:
        j = tl.arange(0, BLOCK)
        zero = num_keys * 0
        src = logits_ptr + row * l_sn
        # round 0: the top digit of every candidate
        hist = tl.zeros([256], dtype=tl.int32)
        for c0 in tl.range(0, num_keys, BLOCK, num_stages=NUM_STAGES):
            u = order_key(tl.load(src + c0 + j, mask=c0 + j < num_keys, other=float("-inf")))
            hist += masked_histogram(((u >> 24) & 0xFF) ^ 0x80, 256, u != -2147483648, HIST_MASK)
        t, rem, done = _descend(hist, zero, zero + k, 24)
        # rounds 1-3: the next digit of the keys sharing the prefix, until every key with the prefix is needed
        for r in tl.static_range(1, 4):
            if done == 0:
                hist = tl.zeros([256], dtype=tl.int32)
                for c0 in tl.range(0, num_keys, BLOCK, num_stages=NUM_STAGES):
                    u = order_key(tl.load(src + c0 + j, mask=c0 + j < num_keys, other=float("-inf")))
                    same = (u != -2147483648) & ((u >> (32 - 8 * r)) == (t >> (32 - 8 * r)))
                    hist += masked_histogram((u >> (24 - 8 * r)) & 0xFF, 256, same, HIST_MASK)
                t, rem, done = _descend(hist, t, rem, 24 - 8 * r)
        # the keys above t and the `rem` lowest-column keys at t (a resolved row's t is its prefix with the lower
        # bits zero: every key at or above it is needed), as _logits_topk_select_kernel writes them
        need = rem
        put = zero
        seen = zero
        for c0 in tl.range(0, num_keys, BLOCK, num_stages=NUM_STAGES):
            cols = c0 + j
            x = tl.load(src + cols, mask=cols < num_keys, other=float("-inf"))
            u = order_key(x)
            ok = u != -2147483648
            gt = ok & (u > t)
            at = ok & (u == t)
            both = gt.to(tl.int32) + (at.to(tl.int32) << 16)
            before = tl.cumsum(both, axis=0) - both
            at_before = seen + (before >> 16)
            pos = row * cap + put + (before & 0xFFFF) + tl.minimum(at_before, need) - tl.minimum(seen, need)
            take = gt | (at & (at_before < need))
            tl.store(val_ptr + pos, x, mask=take)
            tl.store(col_ptr + pos, cols, mask=take)
            total = tl.sum(both, axis=0)
            put += (total & 0xFFFF) + tl.minimum(seen + (total >> 16), need) - tl.minimum(seen, need)
            seen += total >> 16
        for c0 in range(0, cap, BLOCK):  # the rest of the row: padding
            pad = (c0 + j < cap) & (c0 + j >= put)
            tl.store(val_ptr + row * cap + c0 + j, tl.full([BLOCK], float("-inf"), tl.float32), mask=pad)
            tl.store(col_ptr + row * cap + c0 + j, tl.full([BLOCK], -1, tl.int32), mask=pad)


# ----------------------------------------------------------------------------------------- launch
def _select(logits, start, end, slots, k: int, gmax=None) -> torch.Tensor:
    """The kernel path (module docstring): ``[N, k]`` int64 columns or slots, ``-1`` padded."""
    n, num_keys = logits.shape
    dev = logits.device
    if num_keys == 0:
        return torch.full((n, k), -1, dtype=torch.int64, device=dev)
    src = logits
    if start is not None:  # -inf outside the ranges (a copy: the caller's logits stay as they are)
        cols = torch.arange(num_keys, device=dev)
        inside = (cols[None, :] >= start[:, None].to(torch.int64)) & (cols[None, :] < end[:, None].to(torch.int64))
        src = torch.where(inside, logits, torch.full((), float("-inf"), device=dev))
    group = group_size(num_keys, k, rows=n)
    best = _select_grouped(src, k, group, gmax) if group else _select_exact(src, k)
    if slots is None:
        return best
    # the slots after the kernel: a load of them inside it took 148 registers a thread against 63 (sm_90), a third
    # of the programs an SM, and the pass is latency-bound
    return torch.where(best >= 0, slots.to(torch.int64)[best.clamp(0, num_keys - 1)], best)


def group_size(num_keys: int, k: int, *, rows: int | None = None) -> int:
    """The grouped bound's columns a group for ``rows`` rows (``None``: enough) of ``num_keys`` columns
    (:data:`GROUP_CONFIG`), ``0`` where the rows take the exact path."""
    ratio, most = int(GROUP_CONFIG["ratio"]), int(GROUP_CONFIG["max_group"])
    for name, v in (("ratio", ratio), ("cap", int(GROUP_CONFIG["cap"]))):
        if v < 1:  # the bound needs k groups; the candidates' rows hold the k best
            raise ValueError(f"GROUP_CONFIG['{name}'] must be >= 1, got {v}")
    if rows is not None and rows < int(GROUP_CONFIG["min_rows"]):
        return 0
    g = 1
    while 2 * g <= most and num_keys // (2 * g) >= ratio * k:
        g *= 2
    return g if g >= 2 else 0


def _select_exact(src: torch.Tensor, k: int) -> torch.Tensor:
    """Steps 1-3 (module docstring) over ``src`` ``[N, K]`` (``-inf`` outside the candidates): ``[N, k]`` int64
    columns, best first, ``-1`` padded."""
    n, num_keys = src.shape
    dev = src.device
    kk = min(k, num_keys)
    kept = torch.topk(src, kk, dim=1, largest=True, sorted=False).values.contiguous()
    order = torch.empty((n, k), dtype=torch.int32, device=dev)
    cols = torch.empty((n, k), dtype=torch.int32, device=dev)
    block = int(KERNEL_CONFIG["block"])
    if not 0 < block < 2**15 or block & (block - 1):  # the kernel counts two kinds of keys in one int32 scan
        raise ValueError(f"KERNEL_CONFIG['block'] must be a power of two below 2**15, got {block}")
    with device_ctx(dev):
        _logits_topk_select_kernel[(n,)](
            order, cols, src, kept, num_keys, k, kk, src.stride(0),
            BLOCK=block, NUM_STAGES=int(KERNEL_CONFIG["num_stages"]), num_warps=int(KERNEL_CONFIG["num_warps"]),
        )  # fmt: skip
    # best first: a stable sort of the 32-bit order keys keeps equal ones in column order (ties to the lowest
    # column); the padding's -2**31 is below every candidate's
    by = torch.sort(order, dim=1, descending=True, stable=True).indices
    return torch.gather(cols, 1, by).to(torch.int64)


def _select_grouped(src: torch.Tensor, k: int, group: int, gmax: torch.Tensor | None = None) -> torch.Tensor:
    """The grouped bound (module docstring, *rows of many keys*) over ``src`` ``[N, K]``: ``[N, k]`` int64 columns,
    best first, ``-1`` padded; ``gmax``: the group maxima of step 1 where the caller has them."""
    n, num_keys = src.shape
    dev = src.device
    cap = int(GROUP_CONFIG["cap"]) * k
    scan_block, group_block = int(GROUP_CONFIG["scan_block"]), int(GROUP_CONFIG["group_block"])
    for name, v, low in (("scan_block", scan_block, group), ("group_block", group_block, 1)):
        if v < low or v & (v - 1):  # a scan step holds whole groups
            raise ValueError(f"GROUP_CONFIG['{name}'] must be a power of two >= {low}, got {v}")
    num_groups = -(-num_keys // group)
    given = gmax is not None
    if gmax is None:
        gmax = torch.empty((n, num_groups), dtype=torch.int32, device=dev)
    elif gmax.stride(1) != 1 or gmax.stride(0) != num_groups:
        gmax = gmax.contiguous()
    vals = torch.empty((n, cap), dtype=torch.float32, device=dev)
    cols = torch.empty((n, cap), dtype=torch.int32, device=dev)
    gids = torch.empty((n, cap), dtype=torch.int32, device=dev)
    count = torch.empty((n,), dtype=torch.int32, device=dev)
    tile = max(1, 4096 // group)  # groups a program of the group maxima: 4096 columns
    with device_ctx(dev):
        if not given:
            _group_max_kernel[(n, -(-num_groups // tile))](
                gmax, src, num_keys, num_groups, src.stride(0), G=group, BLOCK_G=tile, num_warps=4,
            )  # fmt: skip
        # the bound: the k-th largest group maximum (k groups hold a key at or above it, so the row's k best are)
        bound = torch.topk(gmax, k, dim=1, largest=True, sorted=False).values.amin(dim=1).contiguous()
        _candidates_kernel[(n,)](
            vals, cols, count, gids, src, gmax, bound, num_keys, num_groups, cap, src.stride(0),
            G=group, BLOCK_G=group_block, BLOCK_S=scan_block // group, num_warps=4,
        )  # fmt: skip
        _overflow_rows_kernel[(n,)](
            vals, cols, count, src, num_keys, k, cap, src.stride(0), BLOCK=int(KERNEL_CONFIG["block"]),
            NUM_STAGES=int(KERNEL_CONFIG["num_stages"]), HIST_MASK=HIST_HAS_MASK, num_warps=4,
        )  # fmt: skip
    # the candidates keep column order: the exact path over them breaks ties to the lowest column as over the row
    at = _select_exact(vals, k)
    return torch.where(at >= 0, torch.gather(cols, 1, at.clamp(0, cap - 1)).to(torch.int64), at)


def _check(logits, key_start, key_end, key_slots, k, group_max=None) -> None:
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
    if group_max is not None:
        if key_start is not None:  # the maxima must be of the logits the selection sees
            raise ValueError("group_max takes logits that are -inf outside each row's candidates: pass no key_start")
        group = group_size(num_keys, k, rows=n)
        if not group:
            raise ValueError(
                f"group_max is the grouped bound's first step, but {n} rows of {num_keys} columns (k={k}) take the "
                "exact path (group_size() is 0): pass none"
            )
        check_tensor("group_max", group_max, dtype=torch.int32, shape=(n, -(-num_keys // group)), device=dev)


# ----------------------------------------------------------------------------------------- registered op
@torch.library.custom_op("dtkv::logits_topk", mutates_args=())
def _logits_topk_op(
    logits: torch.Tensor,
    key_start: torch.Tensor | None,
    key_end: torch.Tensor | None,
    key_slots: torch.Tensor | None,
    group_max: torch.Tensor | None,
    k: int,
    backend: str,
) -> torch.Tensor:
    _check(logits, key_start, key_end, key_slots, k, group_max)
    start = None if key_start is None else index_arg(key_start)
    end = None if key_end is None else index_arg(key_end)
    slots = None if key_slots is None else index_arg(key_slots)
    if backend != "triton":
        return logits_topk_torch(logits, k, start, end, slots)
    if logits.shape[0] == 0:
        return torch.empty((0, k), dtype=torch.int64, device=logits.device)
    src = logits if logits.stride(1) == 1 or logits.shape[1] <= 1 else logits.contiguous()
    return _select(src, start, end, slots, k, group_max)


@_logits_topk_op.register_fake
def _fake_logits_topk(logits, key_start, key_end, key_slots, group_max, k, backend):
    _check(logits, key_start, key_end, key_slots, k, group_max)
    return logits.new_empty((logits.shape[0], k), dtype=torch.int64)


# ----------------------------------------------------------------------------------------- public wrapper
def logits_topk(
    logits: torch.Tensor,
    k: int,
    *,
    key_start: torch.Tensor | None = None,
    key_end: torch.Tensor | None = None,
    key_slots: torch.Tensor | None = None,
    group_max: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """The ``k`` best candidates of each row of ``logits``, best first, ties to the lowest column (module
    docstring).

    Run phase: no host synchronization, no data-dependent shapes (the kernel path: ``torch.topk``, one launch,
    ``torch.sort``; on rows of many keys the grouped bound's launches first, module docstring).

    Args:
        logits: float32 ``[N, K]`` (e.g. :func:`dtkv.ops.indexer_logits`'s; ``-inf``: not a candidate).
        k: columns kept per row (``>= 1``; rows with fewer candidates are ``-1`` padded).
        key_start, key_end: int32/int64 ``[N]``, both or neither: row ``n``'s candidates lie in
            ``[key_start[n], key_end[n])`` (clamped to ``[0, K]``; the kernel path masks a copy of the logits:
            logits that are ``-inf`` outside the ranges already, such as the indexer's, need none).
        key_slots: int32/int64 ``[K]``: return ``key_slots[c]`` instead of the column ``c``.
        group_max: int32 ``[N, cdiv(K, G)]``, ``G = group_size(K, k, rows=N)`` (rows that take the grouped bound):
            the logits' group maxima (:func:`dtkv.ops.selection_keys.group_order_maxima`), as
            :func:`dtkv.ops.indexer_logits` writes them with ``group=G``; the kernel path then skips its own pass
            that computes them. Without ``key_start`` (the logits must be ``-inf`` outside the candidates). The
            ``torch`` backend checks and ignores it.
        backend: ``"auto"`` (Triton on CUDA, else torch) | ``"torch"`` | ``"triton"``.

    Returns:
        int64 ``[N, k]``: columns (or their ``key_slots``), ``-1`` past a row's candidates.

    Raises:
        TypeError / ValueError: bad dtypes, shapes or ``k``, naming the argument.
    """
    be = resolve_backend(backend, logits.device)
    return torch.ops.dtkv.logits_topk(logits, key_start, key_end, key_slots, group_max, k, be)
