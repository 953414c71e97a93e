"""The page-table format, defined once (other docstrings link here).

A batch of ``num_reqs`` requests addresses the KV pool through flashinfer-style CSR page tables:

- ``kv_indptr`` int32 ``[num_reqs + 1]``: request ``i`` uses ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]``.
- ``kv_indices`` int32 ``[kv_indptr[-1]]``: logical page ids, in token order; ``-1`` is padding.
- ``kv_last_page_len`` int32 ``[num_reqs]``: tokens used in each request's last page,
  ``0 < kv_last_page_len <= page_size``.
- sequence length of request ``i``: ``(kv_indptr[i+1] - kv_indptr[i] - 1) * page_size + kv_last_page_len[i]``.
- token location (``loc``): ``page * page_size + offset`` with ``0 <= offset < page_size``; ``-1`` is padding.
- ownership: logical page ``p`` is stored on CP rank ``ownership.owner(p)`` at local page
  ``ownership.local_index(p)`` (:class:`dtkv.PageOwnership`: ``p % cp`` for ``interleave``).

Dense page tables ``[num_reqs, max_pages]`` (``-1`` padded) are accepted wherever a flat list is.
"""

from __future__ import annotations

import torch

__all__ = ["pages_to_locs", "seq_lens_from_indptr"]


def pages_to_locs(pages: torch.Tensor, page_size: int, num_tokens: int) -> torch.Tensor:
    """Token locations of the first ``num_tokens`` tokens laid over ``pages`` (int64 ``[num_tokens]``)."""
    t = torch.arange(num_tokens, device=pages.device)
    return pages.to(torch.int64)[t // page_size] * page_size + t % page_size


def seq_lens_from_indptr(kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor, page_size: int) -> torch.Tensor:
    """Sequence lengths ``[num_reqs]`` from the CSR page table (formula in the module docstring)."""
    return (kv_indptr[1:] - kv_indptr[:-1] - 1) * page_size + kv_last_page_len
