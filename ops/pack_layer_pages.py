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
def _copy_block(dst_ptr, src_ptr, row, page, valid, cols, num_words, page_stride):
    m = cols < num_words
    v = tl.load(src_ptr + page * page_stride + cols, mask=m & valid, other=0, eviction_policy="evict_first")
    tl.store(dst_ptr + row * num_words + cols, v, mask=m)


@triton.jit
def _pack_layer_pages_kernel(
    idx_ptr,  # [M] int64: local page of each send row; -1 or >= P = zero row
    num_local_pages,  # P
    dst0, src0, stride0, words0,  # layout 0: dst [M, W_0] words, contiguous; src [P, W_0] words, page stride
    dst1, src1, stride1, words1,  # layouts 1..3: the same (ignored past NUM_LAYOUTS)
    dst2, src2, stride2, words2,
    dst3, src3, stride3, words3,
    NUM_LAYOUTS: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """Program ``(row, layout, c)`` copies words ``[c*BLOCK, (c+1)*BLOCK)`` of one page of one layout."""
    row = tl.program_id(0).to(tl.int64)
    lay = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    page = tl.load(idx_ptr + row)
    valid = (page >= 0) & (page < num_local_pages)
    page = tl.where(valid, page, 0)
    if lay == 0:
        _copy_block(dst0, src0, row, page, valid, cols, words0, stride0)
    if NUM_LAYOUTS > 1:
        if lay == 1:
            _copy_block(dst1, src1, row, page, valid, cols, words1, stride1)
    if NUM_LAYOUTS > 2:
        if lay == 2:
            _copy_block(dst2, src2, row, page, valid, cols, words2, stride2)
    if NUM_LAYOUTS > 3:
        if lay == 3:
            _copy_block(dst3, src3, row, page, valid, cols, words3, stride3)


KERNEL_CONFIG: dict[str, int] = {"block": 4096, "num_warps": 4}
"""Launch parameters (words per program, warps); those of ``dtkv::pack_owned_pages``, swept on an H200."""


def _words(dst: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``dst [M, ...]`` and ``src [P, ...]`` as ``[M, W]`` / ``[P, W]`` of the widest word both allow."""
    d, s = word_view(dst.flatten(1)), word_view(src.flatten(1))
    if d.dtype != s.dtype:
        narrow = d.dtype if d.element_size() < s.element_size() else s.dtype
        d, s = dst.flatten(1).view(narrow), src.flatten(1).view(narrow)
    return d, s


def launch_pack(
    dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], send_idx: torch.Tensor, num_local_pages: int
) -> None:
    """Raw launch on word views (no checks; :func:`pack_layer_pages_into` checks and prepares them).

    Args:
        dsts: per layout ``[M, W_k]`` words, contiguous. srcs: per layout ``[P, W_k]`` words (same dtype as the
            matching ``dsts`` entry), last dim contiguous. send_idx: int64 ``[M]``, contiguous.
    """
    m, k = send_idx.shape[0], len(dsts)
    if m == 0 or k == 0:
        return
    block = min(triton.next_power_of_2(max(d.shape[1] for d in dsts)), KERNEL_CONFIG["block"])
    args = []
    for i in range(MAX_LAYOUTS):
        j = min(i, k - 1)  # unused slots repeat the last layout; the kernel never reads them
        args += [dsts[j], srcs[j], srcs[j].stride(0), dsts[j].shape[1]]
    grid = (m, k, cdiv(max(d.shape[1] for d in dsts), block))
    with device_ctx(send_idx.device):
        _pack_layer_pages_kernel[grid](
            send_idx, num_local_pages, *args, NUM_LAYOUTS=k, BLOCK=block, num_warps=KERNEL_CONFIG["num_warps"]
        )


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
