"""The run phase of one layer of a :class:`dtkv.decode.DecodeStep`: tensor work only, no host sync, capturable.

Legend: ``B`` query rows, ``L`` pages scored per query, ``S`` page size, ``K`` top-k, ``W`` index width
(``K`` padded to the attention kernel's multiple), ``I``/``J`` indexer heads/dims, ``H`` heads, ``R`` latent dims,
``E`` rope dims, ``C`` ranks, ``V`` pages a rank sends to a full view.

Per layer (launches on one H200 in brackets; ``cp > 1`` adds the two exchanges of sharded decode):

1. the new rows, written by their pages' owners (owner filter, no collective) [1: fp8 MLA row and fp8 indexer
   key, :func:`dtkv.ops.quantize_write_mla_indexer_fp8`; 2 for bf16 latent rows];
2. ``full_view`` only: this rank's pages of the batch packed and all-gathered into the view [1 pack + 2 gathers];
3. indexer scores of the pages scored, packed as selection keys (:func:`dtkv.ops.indexer_scores`) [1], local top-k
   (:func:`dtkv.ops.keys_topk` on CUDA: a radix select of 6 digit rounds over many programs a row [9]; elsewhere
   ``torch.topk`` of int64 keys, unsorted);
4. ``sharded`` at ``cp > 1``: the candidates all-gathered, global top-k [1 exchange + a few];
5. selected positions -> token slots of the pages read (``(request, slot)`` coordinates through the plan's
   ``page_map``, rows this rank does not hold -> ``-1``) [2 + 1: :func:`dtkv.ops.sparse_indices`];
6. sparse MLA decode through the attention seam (:mod:`dtkv.attention`: FlashMLA on an H200, the torch reference
   elsewhere) [1-2];
7. ``sharded`` at ``cp > 1``: the partials (``out`` in the kernel's dtype, ``lse``) all-gathered in one message and
   merged by :func:`dtkv.decode.combine_partials` [1 exchange + a few].
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dtkv import ops
from dtkv.decode.attention import combine_partials
from dtkv.decode.topk import key_positions, local_topk
from dtkv.layouts import MLAFp8Layout, MLALatentLayout

__all__ = ["LayerResult", "StepInputs", "partial_message_bytes"]


class StepInputs(NamedTuple):
    """One layer's inputs of a decode step (``B`` rows; padding rows may hold anything finite)."""

    iq: torch.Tensor
    """Indexer queries ``[B, I, J]`` (bf16 on GPUs; float64 for the reference model)."""
    iw: torch.Tensor
    """Indexer head weights ``[B, I]`` (float32; float64 for the reference model)."""
    q: torch.Tensor
    """Absorbed attention queries ``[B, H, R + E]``: latent then rope (bf16 for FlashMLA)."""
    kv_row: torch.Tensor
    """The new KV row of each query ``[B, R + E]`` (bf16; quantized on the way into fp8 pages)."""
    index_k: torch.Tensor
    """The new indexer key of each query ``[B, J]`` (bf16)."""


class LayerResult(NamedTuple):
    """One layer's merged result, identical on every rank."""

    out: torch.Tensor
    """Attention output ``[B, H, R]`` (the kernel's dtype at ``cp = 1``; float32/float64 after a merge)."""
    lse: torch.Tensor
    """Natural-log log-sum-exp of each query's selected logits ``[B, H]``."""
    keys: torch.Tensor
    """int64 ``[B, K]`` the selection as keys, in no particular order (:meth:`dtkv.decode.DecodeStep.positions`
    lists the positions in selection order: the keys sorted, then unpacked)."""


def partial_message_bytes(heads: int, kv_lora_rank: int, out_itemsize: int, lse_itemsize: int) -> int:
    """Bytes of one query's partial in the merge's message: ``out`` then ``lse``."""
    return heads * (kv_lora_rank * out_itemsize + lse_itemsize)


def write_rows(step, kv: torch.Tensor, index: torch.Tensor, x: StepInputs) -> None:
    """The layer's new rows into this rank's pages (rows of pages it does not own are skipped): fp8 MLA rows and
    indexer keys in one launch, latent rows in two."""
    locs, spec, rank = step.fields["new_locs"], step.ownership_spec, step.rank
    lay = step.kv_layout
    if isinstance(lay, MLAFp8Layout):
        ops.quantize_write_mla_indexer_fp8(
            kv, index, x.kv_row, x.index_k, locs, spec, rank, kv_layout=lay, index_layout=step.index_layout,
            validate=False, backend=step.ops_backend,
        )  # fmt: skip
        return
    if isinstance(lay, MLALatentLayout):
        ops.write_owned(kv, x.kv_row.to(lay.dtype), locs, spec, rank, validate=False, backend=step.ops_backend)
    ops.quantize_write_indexer_fp8(
        index, x.index_k, locs, spec, rank, layout=step.index_layout, validate=False, backend=step.ops_backend
    )


def gather_view(step, kv: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Full view of the batch's pages: pack this rank's pages (after the writes), all-gather each layout."""
    send_idx = step.fields["send_idx"]
    kv_send, index_send = step.view_send
    ops.pack_layer_pages_into([kv_send, index_send], [kv, index], send_idx, backend=step.ops_backend)
    kv_view, index_view = step.view_pages
    step.exchange.all_gather(kv_view, kv_send)
    step.exchange.all_gather(index_view, index_send)
    return kv_view, index_view


def select(step, index: torch.Tensor, x: StepInputs) -> torch.Tensor:
    """Indexer over the pages scored, local top-k, and (sharded, ``cp > 1``) the global top-k: int64 ``[B, K]``."""
    f = step.fields
    keys = ops.indexer_scores(
        x.iq, x.iw, index, f["page_ids"], f["page_slots"], f["query_pos"], layout=step.index_layout,
        q_fp8=step.q_fp8, backend=step.indexer_backend,
    )  # fmt: skip
    chosen = _topk(step, keys)
    if not step.merges:
        return chosen
    b, k, cp = chosen.shape[0], step.topk, step.exchange.cp
    gathered = torch.empty((cp, b, k), dtype=torch.int64, device=chosen.device)
    step.exchange.all_gather(gathered, chosen)
    return _topk(step, gathered.transpose(0, 1).reshape(b, cp * k))


def _topk(step, keys: torch.Tensor) -> torch.Tensor:
    """The ``step.topk`` largest keys of each row, as a set: on CUDA :func:`dtkv.ops.keys_topk` (many programs a
    row, largest first; ``torch.topk`` of one row keeps one SM busy), elsewhere ``torch.topk`` unsorted (its
    order is the keys' own: sort them to list it)."""
    if keys.is_cuda:
        return ops.keys_topk(keys, step.topk, return_keys=True, backend=step.ops_backend)
    return local_topk(keys, step.topk, sorted=False)


def attend(step, kv: torch.Tensor, x: StepInputs, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the selected rows of the pages read (others ``-1``), merged across ranks when sharded."""
    # (request, slot) coordinates: position p of row n is n * M * S + p; padding keys land past every page
    coords = step.rowbase + key_positions(chosen)
    idx = step.attn.indices(coords, kv, page_map=step.fields["page_map"])
    out, lse = step.attn.decode(x.q, kv, idx, softmax_scale=step.softmax_scale, schedule=step.schedule)
    if not step.merges:
        return out, lse
    return merge(step, out, lse)


def merge(step, out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather every rank's ``(out, lse)`` in one message and merge them in rank order (same bits everywhere)."""
    b, h, r = out.shape
    ob = h * r * out.element_size()
    msg = torch.empty((b, ob + h * lse.element_size()), dtype=torch.uint8, device=out.device)
    msg[:, :ob].copy_(out.reshape(b, -1).view(torch.uint8))
    msg[:, ob:].copy_(lse.contiguous().view(torch.uint8))
    cp = step.exchange.cp
    gathered = torch.empty((cp, b, msg.shape[1]), dtype=torch.uint8, device=out.device)
    step.exchange.all_gather(gathered, msg)
    dt = lse.dtype
    out_c = gathered[..., :ob].view(out.dtype).view(cp, b, h, r).to(dt)
    lse_c = gathered[..., ob:].view(dt)
    return combine_partials(out_c, lse_c)
