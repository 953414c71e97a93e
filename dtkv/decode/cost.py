"""Bytes one rank moves per layer and decode step: sharded decode against gathering the full view.

==================  ====================================================  ============================================
path                one rank sends per layer and step                     depends on context length
==================  ====================================================  ============================================
sharded decode      ``N * K * 8`` (candidates) +                          no
                    ``N * H * (R + 1) * itemsize`` (partials + LSE)
full view           ``M * page_bytes`` (its owned pages of the batch,      yes: ``M ~ ceil(pages / cp)``
                    padded to the largest per-rank count ``M``)
==================  ====================================================  ============================================

Each rank receives ``cp - 1`` times what it sends (both are all-gathers). At DeepSeek-V3.2 geometry (``H = 128``,
``R = 512``, ``K = 2048``, float32 partials, fp8 MLA rows of 656 B and indexer pages of 8448 B at page size 64) one
query costs 16 KiB of candidates plus 257 KiB of partials per rank, while the full view of a 128K-token request
sends 51.6 MB per rank at cp=2: 185 times more, and it doubles with the context.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtkv._checks import check_int

__all__ = ["DecodeCommBytes", "full_view_comm_bytes", "sharded_decode_comm_bytes"]


@dataclass(frozen=True, kw_only=True, slots=True)
class DecodeCommBytes:
    """Collective traffic of one layer of one decode step, seen from one rank."""

    sent: int
    """Bytes this rank contributes to the layer's all-gathers."""
    received: int
    """Bytes it receives from the other ranks (``(cp_size - 1) * sent``)."""
    num_collectives: int
    """All-gather calls per layer."""

    def __add__(self, other: DecodeCommBytes) -> DecodeCommBytes:
        return DecodeCommBytes(
            sent=self.sent + other.sent,
            received=self.received + other.received,
            num_collectives=self.num_collectives + other.num_collectives,
        )

    def scaled(self, layers: int) -> DecodeCommBytes:
        """The same traffic over ``layers`` layers (a whole decode step)."""
        check_int("layers", layers, min_value=0)
        return DecodeCommBytes(
            sent=self.sent * layers, received=self.received * layers, num_collectives=self.num_collectives * layers
        )


def sharded_decode_comm_bytes(
    *,
    num_queries: int,
    topk: int,
    num_heads: int,
    kv_lora_rank: int,
    cp_size: int,
    partial_itemsize: int = 4,
    lse_itemsize: int | None = None,
) -> DecodeCommBytes:
    """Per-rank bytes of one layer of sharded decode: the candidate all-gather plus the partials' all-gather.

    Args:
        num_queries: queries of the step (one per request being decoded).
        topk: candidates per query and rank (the indexer's top-k).
        num_heads, kv_lora_rank: attention heads and latent dims of the partial outputs.
        cp_size: ranks in the group (no traffic at 1).
        partial_itemsize: bytes per element of the partial outputs (4: float32, 8: the float64 reference model, 2:
            FlashMLA's bf16 output, sent as it is by :class:`dtkv.decode.DecodeStep`).
        lse_itemsize: bytes per element of the LSE (default ``partial_itemsize``; 4 beside bf16 outputs).
    """
    for name, v in (("num_queries", num_queries), ("topk", topk), ("num_heads", num_heads)):
        check_int(name, v, min_value=0)
    check_int("kv_lora_rank", kv_lora_rank, min_value=1)
    check_int("cp_size", cp_size, min_value=1)
    check_int("partial_itemsize", partial_itemsize, min_value=1)
    lse_isz = partial_itemsize if lse_itemsize is None else check_int("lse_itemsize", lse_itemsize, min_value=1)
    if cp_size == 1:
        return DecodeCommBytes(sent=0, received=0, num_collectives=0)
    sent = num_queries * topk * 8 + num_queries * num_heads * (kv_lora_rank * partial_itemsize + lse_isz)
    return DecodeCommBytes(sent=sent, received=(cp_size - 1) * sent, num_collectives=2)


def full_view_comm_bytes(
    *, max_pages_per_rank: int, page_bytes: int, cp_size: int, num_collectives: int = 1
) -> DecodeCommBytes:
    """Per-rank bytes of one layer of materializing the full view (owner-major all-gather of owned pages).

    Args:
        max_pages_per_rank: the largest number of the batch's pages one rank owns (the gather's padded count;
            ``MaterializePlan.history_rows_per_rank + MaterializePlan.current_rows_per_rank``).
        page_bytes: bytes of one page over every layout gathered (e.g. 41 984 + 8 448).
        cp_size: ranks in the group.
        num_collectives: all-gather calls per layer (one per layout and page group).
    """
    check_int("max_pages_per_rank", max_pages_per_rank, min_value=0)
    check_int("page_bytes", page_bytes, min_value=1)
    check_int("cp_size", cp_size, min_value=1)
    check_int("num_collectives", num_collectives, min_value=0)
    if cp_size == 1:
        return DecodeCommBytes(sent=0, received=0, num_collectives=0)
    sent = max_pages_per_rank * page_bytes
    return DecodeCommBytes(sent=sent, received=(cp_size - 1) * sent, num_collectives=num_collectives)
