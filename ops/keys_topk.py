"""``dtkv::keys_topk``: the ``k`` best packed selection keys of each row, best first, spread over many programs a
row -- the decode step's top-k, where a row is one query and a program a row leaves the GPU idle.

Entry point: :func:`keys_topk`; reference :func:`keys_topk_torch`. What it computes is, bit for bit,
:func:`dtkv.ops.indexer_topk` of the keys (``torch.topk`` of the int64 keys: every real key is distinct, so the
order is total), the columns mapped through ``key_slots``:

- row ``n``'s candidates are its keys other than :data:`dtkv.ops.selection_keys.INVALID_KEY`;
- a larger key comes first (:mod:`dtkv.ops.selection_keys`: a higher score, then a lower position);
- the result is ``[N, k]`` int64: the columns of the ``k`` largest candidates (``key_slots[n, c]`` or
  ``key_slots[c]`` with ``key_slots``), best first, ``-1`` past the row's candidates.

**Kernel path** (``triton``), a radix select over the 64-bit keys in digit rounds (:data:`ROUNDS`: 8 rounds of
8 bits, 256 bins), each a launch over ``N x ceil(K / chunk)`` programs:

1. *the digits*: round ``r``'s programs each take round ``r - 1``'s digit from its row histogram (the digit where
   the count of keys from the top reaches the number still needed, with the prefix and count the first program of
   round ``r - 1`` stored: the same scan in every program, so no program waits on another), then add the
   histogram of digit ``r`` of their chunk's keys that share the prefix to the row's histogram
   (``tl.histogram``, then one atomic add a bin). A row is *resolved* once every key with its prefix is needed
   (distinct scores: after the score's bits, usually sooner): the round that sees it stores the round and the
   prefix's shift, and the row's later rounds return at once (a CUDA graph keeps its launches; each costs a flag
   read);
2. *the threshold* ``t``, the ``min(k, K)``-th largest key, is then known to every program of the select launch:
   each writes its chunk's keys above ``t`` and their columns to ``[N, min(k, K)]`` scratch (a base from one
   atomic add a chunk), and keys equal to ``t`` up to the number still needed (``t`` is a real key, unique; or
   the padding key). A resolved row compares the keys' bits above its prefix's shift (an arithmetic shift keeps
   the order): those above, and every one at the prefix (exactly the number still needed);
3. *the order*: each kept key's rank is the number of kept keys of its row above it (ties, padding only, by
   scratch position), computed by comparing tiles of the ``min(k, K)`` kept keys; the rank kernel writes each
   key's column (its slot, or ``-1`` for padding) at its rank, and ``-1`` past ``min(k, K)``.

Eleven launches (a zeroed histogram, eight rounds, select, rank), none a sort; the scratch is ``O(N x k)``.
``benchmarks/bench_keys_topk.py`` times it against ``torch.topk`` of the keys (the decode step's path before it),
eager and as CUDA graphs.

Legend: ``N`` rows (queries), ``K`` key columns, ``k`` kept per row, ``C = min(k, K)``.
"""

from __future__ import annotations

import torch

from dtkv._checks import check_int, check_tensor

from ._common import HIST_HAS_MASK, cdiv, device_ctx, index_arg, masked_histogram, resolve_backend, tl, triton
from .indexer_logits import indexer_topk
from .selection_keys import INVALID_KEY

__all__ = ["KERNEL_CONFIG", "ROUNDS", "keys_topk", "keys_topk_torch", "rounds"]

_IDX_DTYPES = (torch.int32, torch.int64)


def rounds(digit_bits: int) -> tuple[tuple[int, int], ...]:
    """``(shift, bits)`` of each digit round of ``digit_bits``-bit digits, most significant first: together every
    bit of an int64 key once (the last round takes what is left)."""
    out, top = [], 64
    while top > 0:
        bits = min(digit_bits, top)
        out.append((top - bits, bits))
        top -= bits
    return tuple(out)


KERNEL_CONFIG: dict[str, int] = {
    "digit_bits": 8,
    "chunk": 1024,
    "block": 1024,
    "rank_rows": 8,
    "rank_cols": 512,
    "num_warps": 4,
}
"""Launch: ``digit_bits`` a round (:func:`rounds`), ``chunk`` keys a program in the digit and select launches (a
multiple of ``block``, the keys a step), ``rank_rows`` kept keys a program of the rank launch against
``rank_cols`` at a time (powers of two), ``num_warps``. From ``bench_keys_topk.py --sweep`` on one H100
(2026-12-06, with resolved rows returning early): the digit launch is the fastest at one row of 32K keys and within
4% at 16 rows of 128K; the rank launch of 8 rows against 512 columns (256 programs for 2048 kept keys) took one row
of 32K from 0.044 to 0.033 ms a CUDA-graph replay (32 x 128 before: half the SMs idle) and 16 rows of 128K from
0.122 to 0.118 ms. Triton's histogram costs about a bin a thread per 32 keys: 11-bit digits in 6 rounds ran 1.7x
(one row) to 3.6x (16 rows of 128K) slower than 8-bit ones in 8."""
ROUNDS = rounds(KERNEL_CONFIG["digit_bits"])
"""The default launch's digit rounds."""


# ----------------------------------------------------------------------------------------- torch reference
def keys_topk_torch(
    keys: torch.Tensor, k: int, key_slots: torch.Tensor | None, return_keys: bool = False
) -> torch.Tensor:
    """Reference of :func:`keys_topk`: :func:`dtkv.ops.indexer_topk`, the columns mapped through ``key_slots``
    (``return_keys``: ``torch.topk``'s values, :data:`INVALID_KEY` padded)."""
    if return_keys:
        n, num_keys = keys.shape
        out = torch.full((n, k), INVALID_KEY, dtype=torch.int64, device=keys.device)
        if num_keys:
            out[:, : min(k, num_keys)] = torch.topk(keys, min(k, num_keys), dim=1, largest=True, sorted=True).values
        return out
    top, valid = indexer_topk(keys, k)
    if key_slots is None:
        return top
    slots = key_slots.to(torch.int64)
    if slots.ndim == 1:
        mapped = slots[top.clamp(min=0)]
    else:
        mapped = slots.gather(1, top.clamp(min=0)) if slots.shape[1] else torch.full_like(top, -1)
    return torch.where(valid, mapped, torch.full_like(top, -1))


# ----------------------------------------------------------------------------------------- Triton kernels
@triton.jit
def _digit(key, SHIFT: tl.constexpr, BITS: tl.constexpr):
    """Digit ``[SHIFT, SHIFT + BITS)`` of int64 keys, in key order: the top round's sign bit is flipped."""
    d = ((key >> SHIFT) & ((1 << BITS) - 1)).to(tl.int32)
    if SHIFT + BITS == 64:
        d = d ^ (1 << (BITS - 1))
    return d


@triton.jit
def _descend(hist_ptr, prefix, rem, SHIFT: tl.constexpr, BITS: tl.constexpr, BINS: tl.constexpr):
    """From a round's row histogram: its digit (where the count of keys from the top reaches ``rem``), the prefix
    with that digit's bits, how many keys with that prefix are still needed, and whether that is all of them."""
    b = tl.arange(0, BINS)
    h = tl.load(hist_ptr + b)
    above = tl.sum(h, axis=0) - tl.cumsum(h, axis=0)  # keys in bins above b
    d = tl.max(tl.where((above < rem) & (above + h >= rem), b, -1), axis=0)
    rem = rem - tl.sum(tl.where(b == d, above, 0), axis=0)
    done = tl.sum(tl.where(b == d, h, 0), axis=0) == rem
    raw = d
    if SHIFT + BITS == 64:
        raw = d ^ (1 << (BITS - 1))
    return prefix | (raw.to(tl.int64) << SHIFT), rem, done


@triton.jit
def _state(hist_ptr, state_ptr, row, kk, R: tl.constexpr, PSHIFT: tl.constexpr, PBITS: tl.constexpr,
           NR: tl.constexpr, BINS: tl.constexpr):  # fmt: skip
    """``(prefix, rem, done)`` after rounds ``< R``: round ``R - 1``'s histogram (digit ``(PSHIFT, PBITS)``)
    applied to the stored state of rounds ``< R - 1`` (the first round starts from no prefix and ``kk`` needed);
    ``done``: every key with the prefix is needed."""
    if R == 1:
        prefix = tl.zeros([], dtype=tl.int64)
        rem = kk + 0
    else:
        prefix = tl.load(state_ptr + row * (2 * NR + 2) + 2 * (R - 1))
        rem = tl.load(state_ptr + row * (2 * NR + 2) + 2 * (R - 1) + 1).to(tl.int32)
    return _descend(hist_ptr + (row * NR + R - 1) * BINS, prefix, rem, PSHIFT, PBITS, BINS)


@triton.jit(do_not_specialize=["num_keys", "kk", "k_sn"])
def _keys_topk_hist_kernel(
    hist_ptr,  # [N, NR, BINS] int32, zeroed: each round's row histogram
    state_ptr,  # [N, 2 * NR + 2] int64: (prefix, rem) after each round; [2 * NR + 1]: the resolved prefix's shift
    done_ptr,  # [N] int32, zeroed: the round whose state resolved the row (every key of its prefix kept), 0: none
    keys_ptr,  # [N, K] int64; row stride k_sn, columns contiguous
    num_keys,
    kk,  # min(k, K)
    k_sn,
    R: tl.constexpr,  # this round
    SHIFT: tl.constexpr,
    BITS: tl.constexpr,
    PSHIFT: tl.constexpr,  # the previous round's digit (its shift: the prefix's lowest bit)
    PBITS: tl.constexpr,
    NR: tl.constexpr,  # rounds
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    BINS: tl.constexpr,
    HIST_MASK: tl.constexpr,
):
    """Program ``(n, p)``: round ``R``'s histogram of chunk ``p`` of row ``n`` (module docstring, step 1); nothing
    once the row is resolved."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    prefix = tl.zeros([], dtype=tl.int64)
    if R > 0:
        if tl.load(done_ptr + row) != 0:  # resolved by an earlier round's state
            return
        prefix, rem, done = _state(hist_ptr, state_ptr, row, kk, R, PSHIFT, PBITS, NR, BINS)
        if part == 0:
            tl.store(state_ptr + row * (2 * NR + 2) + 2 * R, prefix)
            tl.store(state_ptr + row * (2 * NR + 2) + 2 * R + 1, rem.to(tl.int64))
            if done:
                tl.store(state_ptr + row * (2 * NR + 2) + 2 * NR + 1, PSHIFT)
                tl.store(done_ptr + row, R)
        if done:  # every program of the round sees the same histogram
            return
    j = tl.arange(0, BLOCK)
    local = tl.zeros([BINS], dtype=tl.int32)
    for c0 in range(0, CHUNK, BLOCK):
        cols = part * CHUNK + c0 + j
        inside = cols < num_keys
        key = tl.load(keys_ptr + row * k_sn + cols, mask=inside, other=0)
        take = inside
        if R > 0:
            take = take & ((key >> PSHIFT) == (prefix >> PSHIFT))
        local += masked_histogram(_digit(key, SHIFT, BITS), BINS, take, HIST_MASK)
    b = tl.arange(0, BINS)
    tl.atomic_add(hist_ptr + (row * NR + R) * BINS + b, local, mask=local > 0, sem="relaxed")


@triton.jit(do_not_specialize=["num_keys", "kk", "k_sn"])
def _keys_topk_select_kernel(
    kept_ptr,  # [N, kk] int64, contiguous: the kept keys, in no set order
    kcol_ptr,  # [N, kk] int32, contiguous: their columns
    count_ptr,  # [N, 2] int32, zeroed: keys above t and at t written so far
    hist_ptr,
    state_ptr,
    done_ptr,
    keys_ptr,
    num_keys,
    kk,
    k_sn,
    LSHIFT: tl.constexpr,  # the last round's digit
    LBITS: tl.constexpr,
    NR: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    BINS: tl.constexpr,
):
    """Program ``(n, p)``: the keys of chunk ``p`` of row ``n`` above the threshold, and those at it still needed
    (module docstring, step 2). A row resolved at a prefix compares the keys' bits above its shift only."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    r_done = tl.load(done_ptr + row)
    base_s = row * (2 * NR + 2)
    if r_done != 0:
        t = tl.load(state_ptr + base_s + 2 * r_done)
        rem = tl.load(state_ptr + base_s + 2 * r_done + 1).to(tl.int32)
        sh = tl.load(state_ptr + base_s + 2 * NR + 1)
    else:
        t, rem, _ = _state(hist_ptr, state_ptr, row, kk, NR, LSHIFT, LBITS, NR, BINS)
        sh = tl.zeros([], dtype=tl.int64)
    t_hi = t >> sh
    j = tl.arange(0, BLOCK)
    for c0 in range(0, CHUNK, BLOCK):
        cols = part * CHUNK + c0 + j
        inside = cols < num_keys
        key = tl.load(keys_ptr + row * k_sn + cols, mask=inside, other=0)
        k_hi = key >> sh  # arithmetic: the keys' order kept
        gt = (inside & (k_hi > t_hi)).to(tl.int32)
        at = (inside & (k_hi == t_hi)).to(tl.int32)
        n_gt = tl.sum(gt, axis=0)
        n_at = tl.sum(at, axis=0)
        if n_gt > 0:
            base = tl.atomic_add(count_ptr + row * 2, n_gt)
            pos = row * kk + base + tl.cumsum(gt, axis=0) - gt
            tl.store(kept_ptr + pos, key, mask=gt > 0)
            tl.store(kcol_ptr + pos, cols, mask=gt > 0)
        if n_at > 0:
            base_at = tl.atomic_add(count_ptr + row * 2 + 1, n_at)
            pos = base_at + tl.cumsum(at, axis=0) - at
            tl.store(kept_ptr + row * kk + (kk - rem) + pos, key, mask=(at > 0) & (pos < rem))
            tl.store(kcol_ptr + row * kk + (kk - rem) + pos, cols, mask=(at > 0) & (pos < rem))


@triton.jit(do_not_specialize=["kk", "k", "s_sn"])
def _keys_topk_rank_kernel(
    out_ptr,  # [N, k] int64, contiguous
    kept_ptr,  # [N, kk] int64, contiguous
    kcol_ptr,  # [N, kk] int32, contiguous
    slots_ptr,  # [N, K] or [K] int (row stride s_sn, 0 for [K]); unused without HAS_SLOTS
    kk,
    k,
    s_sn,
    HAS_SLOTS: tl.constexpr,
    OUT_KEYS: tl.constexpr,
    RB: tl.constexpr,
    CB: tl.constexpr,
):
    """Program ``(n, p)``: kept keys ``[p * RB, (p + 1) * RB)`` of row ``n`` to their ranks (step 3); output slots
    of that range past ``kk`` to ``-1``."""
    row = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * RB + tl.arange(0, RB)
    mine_ok = i < kk
    mine = tl.load(kept_ptr + row * kk + i, mask=mine_ok, other=0)
    rank = tl.zeros([RB], dtype=tl.int32)
    for c0 in range(0, kk, CB):
        jj = c0 + tl.arange(0, CB)
        other = tl.load(kept_ptr + row * kk + jj, mask=jj < kk, other=0)
        before = (other[None, :] > mine[:, None]) | ((other[None, :] == mine[:, None]) & (jj[None, :] < i[:, None]))
        rank += tl.sum((before & (jj < kk)[None, :]).to(tl.int32), axis=1)
    valid = mine != -9223372036854775808
    col = tl.load(kcol_ptr + row * kk + i, mask=mine_ok, other=0).to(tl.int64)
    if HAS_SLOTS:
        col = tl.load(slots_ptr + row * s_sn + col, mask=mine_ok & valid, other=-1).to(tl.int64)
    col = tl.where(valid, col, -1)
    if OUT_KEYS:
        col = mine
    pad = -1
    if OUT_KEYS:
        pad = -9223372036854775808
    tl.store(out_ptr + row * k + rank, col, mask=mine_ok)
    tl.store(out_ptr + row * k + i, tl.full([RB], pad, tl.int64), mask=(i >= kk) & (i < k))


# ----------------------------------------------------------------------------------------- launch
def _select(keys: torch.Tensor, k: int, slots: torch.Tensor | None, return_keys: bool = False) -> torch.Tensor:
    """The kernel path (module docstring): ``[N, k]`` int64 columns or slots, ``-1`` padded (the kept keys,
    :data:`INVALID_KEY` padded, with ``return_keys``)."""
    n, num_keys = keys.shape
    dev = keys.device
    out = torch.empty((n, k), dtype=torch.int64, device=dev)
    if num_keys == 0:
        return out.fill_(INVALID_KEY if return_keys else -1)
    cfg = KERNEL_CONFIG
    chunk, block, rb, cb = int(cfg["chunk"]), int(cfg["block"]), int(cfg["rank_rows"]), int(cfg["rank_cols"])
    if block & (block - 1) or chunk % block or rb & (rb - 1) or cb & (cb - 1):
        raise ValueError(
            f"KERNEL_CONFIG needs power-of-two block, rank_rows, rank_cols and chunk % block == 0, got {cfg}"
        )
    digit_bits = int(cfg["digit_bits"])
    if not 1 <= digit_bits <= 12:
        raise ValueError(f"KERNEL_CONFIG['digit_bits'] must be in [1, 12], got {digit_bits}")
    rds = rounds(digit_bits)
    nr, bins = len(rds), 1 << digit_bits
    kk = min(k, num_keys)
    # one memset: histograms, counts, the rows' resolving rounds
    scratch = torch.zeros(n * (nr * bins + 3), dtype=torch.int32, device=dev)
    hist, counts, done = scratch[: n * nr * bins], scratch[n * nr * bins : n * (nr * bins + 2)], scratch[-n:]
    state = torch.empty((n, 2 * nr + 2), dtype=torch.int64, device=dev)
    kept = torch.empty((n, kk), dtype=torch.int64, device=dev)
    kcol = torch.empty((n, kk), dtype=torch.int32, device=dev)
    grid = (n, cdiv(num_keys, chunk))
    warps = int(cfg["num_warps"])
    with device_ctx(dev):
        for r, (shift, bits) in enumerate(rds):
            pshift, pbits = rds[r - 1] if r else (0, 0)
            _keys_topk_hist_kernel[grid](
                hist, state, done, keys, num_keys, kk, keys.stride(0),
                R=r, SHIFT=shift, BITS=bits, PSHIFT=pshift, PBITS=pbits, NR=nr, CHUNK=chunk, BLOCK=block, BINS=bins,
                HIST_MASK=HIST_HAS_MASK, num_warps=warps,
            )  # fmt: skip
        _keys_topk_select_kernel[grid](
            kept, kcol, counts, hist, state, done, keys, num_keys, kk, keys.stride(0),
            LSHIFT=rds[-1][0], LBITS=rds[-1][1], NR=nr, CHUNK=chunk, BLOCK=block, BINS=bins, num_warps=warps,
        )  # fmt: skip
        s_arg = slots if slots is not None else out
        s_sn = 0 if slots is None or slots.ndim == 1 else slots.stride(0)
        _keys_topk_rank_kernel[(n, cdiv(k, rb))](
            out, kept, kcol, s_arg, kk, k, s_sn,
            HAS_SLOTS=slots is not None, OUT_KEYS=return_keys, RB=rb, CB=cb, num_warps=warps,
        )  # fmt: skip
    return out


def _check(keys: torch.Tensor, key_slots: torch.Tensor | None, k: int, return_keys: bool) -> None:
    check_int("k", k, min_value=1)
    if return_keys and key_slots is not None:
        raise ValueError("key_slots and return_keys=True exclude each other: the kept keys carry no slots")
    check_tensor("keys", keys, dtype=torch.int64, ndim=2)
    n, num_keys = keys.shape
    if num_keys >= 2**31 - 1:
        raise ValueError(f"keys must have fewer than 2**31 - 1 columns, got {num_keys}")
    if key_slots is not None:
        if key_slots.ndim == 1:
            check_tensor("key_slots", key_slots, dtype=_IDX_DTYPES, shape=(num_keys,), device=keys.device)
        else:
            check_tensor("key_slots", key_slots, dtype=_IDX_DTYPES, shape=(n, num_keys), device=keys.device)


# ----------------------------------------------------------------------------------------- registered op
@torch.library.custom_op("dtkv::keys_topk", mutates_args=())
def _keys_topk_op(
    keys: torch.Tensor, key_slots: torch.Tensor | None, k: int, return_keys: bool, backend: str
) -> torch.Tensor:
    _check(keys, key_slots, k, return_keys)
    if backend != "triton":
        return keys_topk_torch(keys, k, key_slots, return_keys)
    if keys.shape[0] == 0:
        return torch.empty((0, k), dtype=torch.int64, device=keys.device)
    src = keys if keys.stride(1) == 1 or keys.shape[1] <= 1 else keys.contiguous()
    slots = None
    if key_slots is not None:
        slots = index_arg(key_slots) if key_slots.ndim == 1 else key_slots
        if slots.ndim == 2 and slots.shape[1] > 1 and slots.stride(1) != 1:
            slots = slots.contiguous()
    return _select(src, k, slots, return_keys)


@_keys_topk_op.register_fake
def _fake_keys_topk(keys, key_slots, k, return_keys, backend):
    _check(keys, key_slots, k, return_keys)
    return keys.new_empty((keys.shape[0], k), dtype=torch.int64)


# ----------------------------------------------------------------------------------------- public wrapper
def keys_topk(
    keys: torch.Tensor,
    k: int,
    *,
    key_slots: torch.Tensor | None = None,
    return_keys: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """The columns of the ``k`` largest packed selection keys of each row, best first (module docstring).

    Run phase: no host synchronization, no data-dependent shapes (CUDA-graph capturable).

    Args:
        keys: int64 ``[N, K]``: :func:`dtkv.ops.indexer_logits` ``packed=True`` output, or
            :func:`dtkv.ops.selection_keys.selection_keys` of any scores with the columns as positions.
        k: kept per row (``>= 1``; rows with fewer candidates are ``-1`` padded).
        key_slots: int32/int64 ``[K]`` or ``[N, K]``: return ``key_slots[c]`` (``key_slots[n, c]``) instead of
            the column ``c``.
        return_keys: return the kept keys themselves, largest first, :data:`INVALID_KEY` past a row's
            candidates (sharded decode's candidates: their positions travel in them); excludes ``key_slots``.
        backend: ``"auto"`` (Triton on CUDA, else torch) | ``"torch"`` | ``"triton"``.

    Returns:
        int64 ``[N, k]``: columns (or their slots), ``-1`` past a row's candidates; or the keys.

    Raises:
        TypeError / ValueError: bad dtypes, shapes or ``k``, naming the argument.
    """
    return torch.ops.dtkv.keys_topk(keys, key_slots, k, bool(return_keys), resolve_backend(backend, keys.device))
