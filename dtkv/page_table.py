"""The page-table format, defined once (other docstrings link here).

A batch of ``num_reqs`` requests addresses the KV pool through flashinfer-style CSR page tables:

- ``kv_indptr`` int32 ``[num_reqs + 1]``: request ``i`` uses ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]``.
- ``kv_indices`` int32 ``[kv_indptr[-1]]``: logical page ids, in token order; ``-1`` is padding.
- ``kv_last_page_len`` int32 ``[num_reqs]``: tokens used in each request's last page,
  ``0 < kv_last_page_len <= page_size``.
- sequence length of request ``i``: ``(kv_indptr[i+1] - kv_indptr[i] - 1) * page_size + kv_last_page_len[i]``.
- token location (``loc``): ``page * page_size + offset`` with ``0 <= offset < page_size``; ``-1`` is padding.
- ownership: logical page ``p`` is stored on CP rank ``ownership.owner(p)`` at local page
  ``ownership.local_index(p)`` (:class:`dtkv.PageOwnership`: ``p % cp_size`` under the ``interleave`` scheme).

Dense page tables ``[num_reqs, max_pages]`` (``-1`` padded) are accepted wherever a flat list is.

Glossary (the words every module and docstring uses):

==========================  ==================================================================================
page                        ``page_size`` consecutive token positions of one request's KV, stored as one row
                            of dim 0 of a pool; a *logical page* id indexes the whole (unsharded) pool.
location (``loc``)          ``page * page_size + offset``: where one token's row lives (``-1``: padding).
position                    a token's absolute index in its request (``prefix_len + extend offset``); page
                            slot ``position // page_size`` of the request's page list holds it.
ownership scheme            which CP rank *stores* each logical page: ``"interleave"`` (``p % cp_size``) or
                            ``"block"`` (contiguous ranges of ``pages_per_rank``); :class:`dtkv.PageOwnership`
                            (``scheme=``), never called a layout.
layout                      the byte format of a stored page: :class:`dtkv.KVLayout` and its subclasses
                            (bf16 MLA latent, 656-byte fp8 row, 8448-byte indexer page).
storage owner               the rank that stores a page: ``ownership.owner(page)``. *Ownership* always means
                            this (who stores a page), never who computes it.
compute owner               the rank whose CP split computes a page's extend tokens this step
                            (:func:`dtkv.split.compute_owners`); with a page-aligned split there is one.
direct write                a rank writing the rows it computed straight into its own pool: allowed where it is
                            both compute and storage owner (:func:`dtkv.split.verify_direct_write`).
handoff page                a page a rank computes but does not store; its rows go to the storage owner
                            through an all-gather and an owner-filtered write (:func:`dtkv.split.handoff_pages`).
history / current pages     the pages a step only reads (before each prefix end; prefetchable) / the pages it
                            writes (:mod:`dtkv.materialize`).
view                        a full-layout copy of the pages a batch reads, assembled from the owners' pages,
                            with a remapped page table, so unmodified attention kernels can read it.
token chunk (``chunk``)     the tokens computed per request per step of chunked prefill (``chunk_size``); the
                            only thing called a chunk.
layer group                 consecutive layers the transfer pipeline sends together (:mod:`dtkv.transfer`).
rows per rank               rows each rank contributes to an owner-major all-gather of a page list (padded).
runtime                     what runs a model (prefill, decode, PD) over dtkv pools:
                            :class:`dtkv.runtime.Runtime`, one for every model; never called a runner.
transfer engine             what moves bytes between processes: Mooncake's, or the in-process one
                            (:mod:`dtkv.transfer`).
``cp_size``, ``page_size``  ranks of the CP group, tokens per page: the names every public signature uses.
==========================  ==================================================================================
"""

from __future__ import annotations

import torch

from dtkv._checks import check_int

__all__ = ["pages_to_locs", "seq_lens_from_indptr"]


def pages_to_locs(pages: torch.Tensor, page_size: int, num_tokens: int) -> torch.Tensor:
    """Token locations of the first ``num_tokens`` tokens laid over ``pages`` (int64 ``[num_tokens]``).

    Args:
        pages: integer ``[k]`` with ``k >= ceil(num_tokens / page_size)``: one request's pages in token order.
        page_size: tokens per page (>= 1).
        num_tokens: tokens to locate (>= 0).
    """
    check_int("page_size", page_size, min_value=1)
    check_int("num_tokens", num_tokens, min_value=0)
    t = torch.arange(num_tokens, device=pages.device)
    return pages.to(torch.int64)[t // page_size] * page_size + t % page_size


def seq_lens_from_indptr(kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor, page_size: int) -> torch.Tensor:
    """Sequence lengths ``[num_reqs]`` from the CSR page table (formula in the module docstring)."""
    return (kv_indptr[1:] - kv_indptr[:-1] - 1) * page_size + kv_last_page_len
