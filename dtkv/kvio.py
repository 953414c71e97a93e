"""The layout codec: rows in and out of pages of every stored format, for every model and for sharded decode.

Every stored byte goes through :mod:`dtkv.ops`; every read of stored rows goes through here.

- :func:`write_rows`: store rows at logical token locations, owner-filtered (``direct=False``: each rank keeps the
  rows of the pages it stores, whoever computed them) or as a compute-owner direct write (``direct=True``: this
  rank's own rows into its own pages, page-aligned split); fp8 layouts quantize on the way (fused ops).
- :func:`read_rows`: pages ``[V, *page_shape]`` (a full view, a whole pool, a rank's own pages) -> rows dequantized
  to a compute dtype, of every token slot in slot order ``[V * page_size, C]`` or only of the token slots ``slots``
  (gathered before they are dequantized: ``[*slots.shape, C]`` whatever ``V``): what attention and the indexers
  read through remapped indices.
- :func:`round_trip`: rows as a pool of a layout gives them back (stored, then read), without a pool: what a
  reference computes with.
- :func:`random_pages`: fill pages with random bytes that decode to finite rows (benchmarks and tests that need
  stored KV without computing it).

``C`` is ``kv_lora_rank + rope_dim`` for MLA layouts (an indexer stored as bf16/fp32 rows is an
``MLALatentLayout`` with ``rope_dim=0``) and ``head_dim`` for :class:`dtkv.IndexerFp8Layout`. A token slot ``t`` is
token ``t % page_size`` of page ``t // page_size`` of the pages given.
"""

from __future__ import annotations

import torch

from dtkv import ops
from dtkv.layouts import IndexerFp8Layout, KVLayout, MLAFp8Layout, MLALatentLayout
from dtkv.ownership import OwnershipSpec, PageOwnership

__all__ = ["random_pages", "read_rows", "round_trip", "write_rows"]


def _bad_layout(layout: object) -> TypeError:
    return TypeError(f"layout must be an MLA or indexer layout, got {type(layout).__name__}")


def write_rows(
    pool: torch.Tensor,
    layout: KVLayout,
    rows: torch.Tensor,
    locs: torch.Tensor,
    ownership: PageOwnership | OwnershipSpec,
    rank: int,
    *,
    direct: bool = False,
    validate: bool | None = None,
) -> None:
    """Write ``rows`` ``[N, C]`` (any float dtype) at logical ``locs`` int64 ``[N]`` (``-1`` skipped) into ``pool``.

    ``direct=True`` is the compute-owner write of a page-aligned split (every location on a page ``rank`` stores,
    see :func:`dtkv.ops.direct_write`). ``validate`` is the write ops' switch: ``None`` validates the locations on
    the host in eager mode (one synchronization); ``False`` skips it (invalid locations are skipped by the kernels,
    never written), for locations that are valid by construction (a runtime step's plan).
    """
    if isinstance(layout, MLALatentLayout):
        rows = rows.to(layout.dtype)
        if direct:
            ops.direct_write(pool, rows, locs, ownership, rank, validate=validate)
        else:
            ops.write_owned(pool, rows, locs, ownership, rank, validate=validate)
    elif isinstance(layout, MLAFp8Layout):
        ops.quantize_write_mla_fp8(pool, rows, locs, ownership, rank, layout=layout, direct=direct, validate=validate)
    elif isinstance(layout, IndexerFp8Layout):
        ops.quantize_write_indexer_fp8(pool, rows, locs, ownership, rank, layout=layout, direct=direct,
                                       validate=validate)  # fmt: skip
    else:
        raise _bad_layout(layout)


def read_rows(
    pages: torch.Tensor, layout: KVLayout, dtype: torch.dtype, *, slots: torch.Tensor | None = None
) -> torch.Tensor:
    """Rows of the token slots of ``pages`` ``[V, *layout.page_shape]``, dequantized to ``dtype``.

    Args:
        pages: the pages (any ``V``, ``0`` included when ``slots`` is ``None``).
        layout: their stored format.
        dtype: the compute dtype of the result.
        slots: int64 token slots ``[...]`` in ``[0, V * page_size)`` to read (gathered first); ``None``: every slot.

    Returns:
        ``[V * page_size, C]`` (``slots=None``) or ``[*slots.shape, C]`` of ``dtype``; a slot's row is the same
        bits either way.
    """
    ps, v = layout.page_size, pages.shape[0]
    if isinstance(layout, MLALatentLayout):
        flat = pages.reshape(v * ps, layout.row_dim)
        return (flat if slots is None else flat[slots]).to(dtype)
    if isinstance(layout, MLAFp8Layout):
        flat = pages.reshape(v * ps, layout.row_bytes)
        return ops.dequantize_mla_fp8(flat if slots is None else flat[slots], layout).to(dtype)
    if isinstance(layout, IndexerFp8Layout):
        if slots is None:
            return ops.dequantize_indexer_pages(pages, layout).reshape(v * ps, layout.head_dim).to(dtype)
        hd = layout.head_dim
        page, t = slots // ps, slots % ps
        codes = pages[:, : ps * hd].reshape(v, ps, hd)[page, t]  # [..., J] e4m3 bytes
        scales = pages[:, ps * hd :].reshape(v, ps, 4)[page, t].contiguous().view(torch.float32)  # [..., 1]
        return (codes.view(torch.float8_e4m3fn).float() * scales).to(dtype)
    raise _bad_layout(layout)


def round_trip(rows: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """``rows`` ``[..., C]`` as a pool of ``layout`` gives them back (stored, then read): same shape and dtype.

    ``MLALatentLayout``: a cast to the store dtype and back; ``MLAFp8Layout`` / ``IndexerFp8Layout``: the fp8
    quantization of :mod:`dtkv.ops` and its dequantization (bitwise what :func:`write_rows` then
    :func:`read_rows` give).
    """
    flat = rows.reshape(-1, rows.shape[-1])
    if isinstance(layout, MLALatentLayout):
        out = flat.to(layout.dtype)
    elif isinstance(layout, MLAFp8Layout):
        out = ops.dequantize_mla_fp8(ops.quantize_mla_fp8(flat, layout), layout)
    elif isinstance(layout, IndexerFp8Layout):
        codes, scale = ops.quantize_indexer_fp8(flat)
        out = codes.view(torch.float8_e4m3fn).float() * scale[:, None]
    else:
        raise _bad_layout(layout)
    return out.to(rows.dtype).reshape(rows.shape)


def random_pages(
    pages: torch.Tensor,
    layout: KVLayout,
    generator: torch.Generator,
    *,
    scales: tuple[float, float] = (2e-3, 4e-3),
) -> None:
    """Fill ``pages`` ``[P, *layout.page_shape]`` (in place) with random stored bytes that decode to finite rows.

    fp8 layouts: e4m3 codes drawn uniformly from every byte but the two NaN patterns (``0x7F``, ``0xFF``), fp32
    scales uniform in ``scales``, bf16 rope ``N(0, 1)``; a latent (row) layout: rows ``N(0, 0.5)``. ``generator``
    lives on ``pages``' device.
    """
    if isinstance(layout, MLALatentLayout):
        pages.view(layout.dtype).normal_(0.0, 0.5, generator=generator)
        return
    if not isinstance(layout, (MLAFp8Layout, IndexerFp8Layout)):
        raise _bad_layout(layout)
    lo, hi = scales
    pages.random_(0, 256, generator=generator)
    if isinstance(layout, MLAFp8Layout):
        codes = pages[..., : layout.kv_lora_rank]
        pages[..., layout.scale_offset : layout.rope_offset].view(torch.float32).uniform_(lo, hi, generator=generator)
        pages[..., layout.rope_offset :].view(torch.bfloat16).normal_(generator=generator)
    else:
        codes = pages[:, : layout.scale_offset]
        pages[:, layout.scale_offset :].view(torch.float32).uniform_(lo, hi, generator=generator)
    codes.masked_fill_((codes & 0x7F) == 0x7F, 0x7E)  # 0x7F / 0xFF are NaN in e4m3fn
