"""``dtkv::pack_layer_pages``: one page list packed out of every layout of a layer, in one kernel launch.

Entry points: :func:`pack_layer_pages` (the registered op: functional, compiles with ``fullgraph=True``) and
:func:`pack_layer_pages_into` (eager: writes preallocated send buffers through a direct kernel launch, with no
custom-op dispatch; the hot path of :class:`dtkv.materialize.Materializer`).

A layer's pools (one per layout: MLA rows, indexer pages, ...) share their local page numbering, so one send list
``send_idx`` (int64 ``[M]``, the local page of each send row) serves them all: ``out_k[m] = pools_k[send_idx[m]]``,
a zero page where ``send_idx[m]`` is ``-1`` or ``>= P``. :func:`dtkv.ops.plan_pack` makes such lists (rank ``r``'s
row of ``send_local_idx``). Pages are copied as machine words, never converted, so any dtype works.

Legend: ``P`` local pages, ``M`` send rows, ``K`` layouts, ``W_k`` words of one page of layout ``k``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dtkv._checks import check_tensor

from ._common import cdiv, check_pages_contiguous, device_ctx, index_arg, resolve_backend, tl, triton, word_view
from ._copy import load_span, needs_int64, span_chunks, store_span
from ._tuned import launch_config

__all__ = ["MAX_LAYOUTS", "pack_layer_pages", "pack_layer_pages_into", "pack_layer_pages_torch"]

MAX_LAYOUTS = 4
"""Layouts one launch packs (DSA layers have two: the MLA rows and the indexer pages)."""


# ----------------------------------------------------------------------------------------- torch reference
def pack_layer_pages_torch(pools: Sequence[torch.Tensor], send_idx: torch.Tensor) -> list[torch.Tensor]:
    """Reference: ``pool.index_select(0, send_idx)`` per pool, zero pages where ``send_idx`` is ``-1`` or ``>= P``."""
    idx = send_idx.to(torch.int64)
    outs = []
    for pool in pools:
        ok = (idx >= 0) & (idx < pool.shape[0])
        out = pool.new_zeros((idx.shape[0], *pool.shape[1:]))
        if pool.shape[0]:
            rows = ok.nonzero().squeeze(1)
            out[rows] = pool.index_select(0, idx[rows])
        outs.append(out)
    return outs


# ----------------------------------------------------------------------------------------- Triton kernel
@triton.jit
def _pack_part(dst_ptr, src_ptr, page_stride, row, page, valid, rmask, part, W: tl.constexpr, PARTS: tl.constexpr,
               CW0: tl.constexpr, CW1: tl.constexpr, CW2: tl.constexpr, CW3: tl.constexpr):  # fmt: skip
    """Copy part ``part`` (``W / PARTS`` words) of page ``page`` to send row ``row`` of each tile row (zeros where
    not ``valid``)."""
    # annotated: a plain assignment would make SPAN a runtime scalar (Triton 3.6 and 3.7 turn every assigned
    # constant into a tensor), and _chunk's `if C + CW > SPAN` a runtime branch whose sides differ in shape
    SPAN: tl.constexpr = W // PARTS
    v0, v1, v2, v3 = load_span(src_ptr, page * page_stride + part * SPAN, valid, SPAN, CW0, CW1, CW2, CW3)
    store_span(dst_ptr, row * W + part * SPAN, rmask, v0, v1, v2, v3, SPAN, CW0, CW1, CW2, CW3)


@triton.jit
def _pack_layer_pages_kernel(
    idx_ptr,  # [M] int64: local page of each send row; -1 or >= P = zero row
    num_rows,  # M
    num_local_pages,  # P
    dst0, src0, stride0,  # layout 0: dst [M, W0] words, contiguous; src [P, W0] words, page stride stride0
    dst1, src1, stride1,  # layouts 1..3: the same (ignored past NUM_LAYOUTS)
    dst2, src2, stride2,
    dst3, src3, stride3,
    W0: tl.constexpr, A0: tl.constexpr, B0: tl.constexpr, C0: tl.constexpr, D0: tl.constexpr,  # words, chunks
    W1: tl.constexpr, A1: tl.constexpr, B1: tl.constexpr, C1: tl.constexpr, D1: tl.constexpr,
    W2: tl.constexpr, A2: tl.constexpr, B2: tl.constexpr, C2: tl.constexpr, D2: tl.constexpr,
    W3: tl.constexpr, A3: tl.constexpr, B3: tl.constexpr, C3: tl.constexpr, D3: tl.constexpr,
    NUM_LAYOUTS: tl.constexpr,
    PARTS: tl.constexpr,
    ROWS: tl.constexpr,
    OFF64: tl.constexpr,
):  # fmt: skip
    """Program ``(i, layout * PARTS + part)`` copies part ``part`` of the pages of send rows ``[i*ROWS, (i+1)*ROWS)``
    of one layout, every chunk of a part loaded before any is stored (``ops/_copy.py``)."""
    if OFF64:
        row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    else:
        row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    q = tl.program_id(1)
    lay = q // PARTS
    part = q - lay * PARTS
    rmask = row < num_rows
    page = tl.load(idx_ptr + row, mask=rmask, other=-1)
    valid = rmask & (page >= 0) & (page < num_local_pages)
    page = tl.where(valid, page, 0)
    if not OFF64:
        page = page.to(tl.int32)
    if lay == 0:
        _pack_part(dst0, src0, stride0, row, page, valid, rmask, part, W0, PARTS, A0, B0, C0, D0)
    if NUM_LAYOUTS > 1:
        if lay == 1:
            _pack_part(dst1, src1, stride1, row, page, valid, rmask, part, W1, PARTS, A1, B1, C1, D1)
    if NUM_LAYOUTS > 2:
        if lay == 2:
            _pack_part(dst2, src2, stride2, row, page, valid, rmask, part, W2, PARTS, A2, B2, C2, D2)
    if NUM_LAYOUTS > 3:
        if lay == 3:
            _pack_part(dst3, src3, stride3, row, page, valid, rmask, part, W3, PARTS, A3, B3, C3, D3)


def _words(dst: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``dst [M, ...]`` and ``src [P, ...]`` as ``[M, W]`` / ``[P, W]`` of the widest word both allow."""
    d, s = word_view(dst.flatten(1)), word_view(src.flatten(1))
    if d.dtype != s.dtype:
        narrow = d.dtype if d.element_size() < s.element_size() else s.dtype
        d, s = dst.flatten(1).view(narrow), src.flatten(1).view(narrow)
    return d, s


def _parts(requested: int, widths: Sequence[int]) -> int:
    """The largest power of two ``<= requested`` that divides every layout's page width (1 at least)."""
    p = 1 << max(int(requested), 1).bit_length() - 1
    while p > 1 and any(w % p for w in widths):
        p //= 2
    return p


def launch_pack(
    dsts: Sequence[torch.Tensor],
    srcs: Sequence[torch.Tensor],
    send_idx: torch.Tensor,
    num_local_pages: int,
    *,
    op: str = "pack_layer_pages",
) -> None:
    """Raw launch on word views (no checks; :func:`pack_layer_pages_into` checks and prepares them), configured by
    ``ops/_tuned.py`` entry ``op`` (``"pack_layer_pages"`` or ``"pack_owned_pages"``) for ``M`` send rows.

    Args:
        dsts: per layout ``[M, W_k]`` words, contiguous. srcs: per layout ``[P, W_k]`` words (same dtype as the
            matching ``dsts`` entry), last dim contiguous. send_idx: int64 ``[M]``, contiguous.
    """
    m, k = send_idx.shape[0], len(dsts)
    if m == 0 or k == 0:
        return
    cfg = launch_config(op, m, send_idx.device)
    widths = [d.shape[1] for d in dsts]
    parts = _parts(int(cfg["parts"]), widths)
    rows = int(cfg["rows"])
    args, consts = [], {}
    for i in range(MAX_LAYOUTS):
        j = min(i, k - 1)  # unused slots repeat the last layout; the kernel never reads them
        args += [dsts[j], srcs[j], srcs[j].stride(0)]
        consts[f"W{i}"] = widths[j]
        for name, cw in zip("ABCD", span_chunks(widths[j] // parts, int(cfg["chunk_w"]))):
            consts[f"{name}{i}"] = cw
    off64 = needs_int64(
        (m + rows) * max(widths), *(s.shape[0] * s.stride(0) + w for s, w in zip(srcs, widths)), num_local_pages
    )
    with device_ctx(send_idx.device):
        _pack_layer_pages_kernel[(cdiv(m, rows), k * parts)](
            send_idx, m, num_local_pages, *args, **consts, NUM_LAYOUTS=k, PARTS=parts, ROWS=rows, OFF64=off64,
            num_warps=int(cfg["num_warps"]),
        )  # fmt: skip


def _check(pools: Sequence[torch.Tensor], send_idx: torch.Tensor) -> None:
    if not isinstance(pools, (list, tuple)) or not 1 <= len(pools) <= MAX_LAYOUTS:
        raise ValueError(f"pools must be a list of 1 to {MAX_LAYOUTS} tensors, got {type(pools).__name__}")
    check_tensor("send_idx", send_idx, dtype=(torch.int64, torch.int32), ndim=1)
    for i, pool in enumerate(pools):
        check_tensor(f"pools[{i}]", pool, device=send_idx.device)
        check_pages_contiguous(f"pools[{i}]", pool)
        if pool.shape[0] != pools[0].shape[0]:
            raise ValueError(
                f"pools must share their local page count, got pools[0].shape[0]={pools[0].shape[0]} and "
                f"pools[{i}].shape[0]={pool.shape[0]}"
            )


# ----------------------------------------------------------------------------------------- registered op
@torch.library.custom_op("dtkv::pack_layer_pages", mutates_args=())
def _pack_layer_pages_op(pools: list[torch.Tensor], send_idx: torch.Tensor, backend: str) -> list[torch.Tensor]:
    _check(pools, send_idx)
    send_idx = index_arg(send_idx, torch.int64)
    if backend != "triton":
        return pack_layer_pages_torch(pools, send_idx)
    outs = [p.new_empty((send_idx.shape[0], *p.shape[1:])) for p in pools]
    _launch_checked(outs, pools, send_idx)
    return outs


@_pack_layer_pages_op.register_fake
def _fake_pack_layer_pages(pools, send_idx, backend):
    _check(pools, send_idx)
    return [p.new_empty((send_idx.shape[0], *p.shape[1:])) for p in pools]


def _launch_checked(outs: Sequence[torch.Tensor], pools: Sequence[torch.Tensor], send_idx: torch.Tensor) -> None:
    if not pools or outs[0].numel() == 0:
        return
    pairs = [_words(o, p) for o, p in zip(outs, pools)]
    launch_pack([d for d, _ in pairs], [s for _, s in pairs], index_arg(send_idx, torch.int64), pools[0].shape[0])


# ----------------------------------------------------------------------------------------- public wrappers
def pack_layer_pages(
    pools: Sequence[torch.Tensor], send_idx: torch.Tensor, *, backend: str = "auto"
) -> list[torch.Tensor]:
    """The send rows of every layout of a layer (functional; the registered op, compiles).

    Args:
        pools: one tensor per layout, ``[P, *page_shape_k]`` (pages contiguous, any page stride, any dtype),
            all with the same ``P``; 1 to :data:`MAX_LAYOUTS` of them.
        send_idx: int32/int64 ``[M]``, any strides: the local page of each send row; ``-1`` (or any value outside
            ``[0, P)``) gives a zero page.
        backend: ``"auto"`` | ``"torch"`` | ``"triton"`` (one launch for every layout).

    Returns:
        One tensor per pool, ``[M, *page_shape_k]`` of the pool's dtype.
    """
    if not pools:
        raise ValueError("pools must hold at least one tensor, got an empty list")
    return torch.ops.dtkv.pack_layer_pages(list(pools), send_idx, resolve_backend(backend, send_idx.device))


def pack_layer_pages_into(
    outs: Sequence[torch.Tensor], pools: Sequence[torch.Tensor], send_idx: torch.Tensor, *, backend: str = "auto"
) -> None:
    """Eager: write :func:`pack_layer_pages`'s result into preallocated ``outs`` (no op dispatch, no allocation).

    Args:
        outs: per pool a contiguous ``[M, *page_shape_k]`` tensor of the pool's dtype (e.g. slices of a send buffer).
        pools, send_idx, backend: as :func:`pack_layer_pages`.
    """
    _check(list(pools), send_idx)
    if len(outs) != len(pools):
        raise ValueError(f"outs must hold one tensor per pool, got {len(outs)} outs for {len(pools)} pools")
    for i, (o, p) in enumerate(zip(outs, pools)):
        check_tensor(f"outs[{i}]", o, dtype=p.dtype, shape=(send_idx.shape[0], *p.shape[1:]), device=p.device)
        if not o.is_contiguous():
            raise ValueError(f"outs[{i}] must be contiguous, got stride {o.stride()}")
    if resolve_backend(backend, send_idx.device) != "triton":
        for o, r in zip(outs, pack_layer_pages_torch(pools, send_idx)):
            o.copy_(r)
        return
    _launch_checked(outs, pools, send_idx)
