"""Partial MLA attention over a rank's own selected rows, and the LSE-weighted merge of the partials across ranks.

Legend: ``N`` queries, ``H`` heads, ``K`` selected rows (the global top-k), ``R`` latent dims (``kv_lora_rank``),
``E`` rope dims, ``C`` ranks.

Each rank attends over the selected rows it owns (the others are masked) and returns ``out_NHR`` (softmax over its
rows only) and ``lse_NH`` (log-sum-exp of its logits; ``-inf`` and zeros when it owns none). The merge is the exact
identity of split softmax::

    lse = log(sum_c exp(lse_c))        out = sum_c exp(lse_c - lse) * out_c

computed on every rank from the same gathered tensors in rank order, so every rank gets the same bits. Against one
softmax over all ``K`` rows it only changes the floating-point summation order: in float64 the relative difference
is a few ``K * 2**-53`` (about 1e-14 at ``K = 2048``).

**Bytes.** One all-gather of ``[N, H * R + H]`` in the partials' dtype per layer and step: each rank contributes
``N * H * (R + 1) * itemsize`` bytes (262 656 per query at 128 heads, R = 512, float32), whatever the context length.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dtkv._collectives import all_gather_rows, group_size

__all__ = ["combine_partials", "merge_partials", "partial_attention"]


def partial_attention(
    q_nope_NHR: torch.Tensor,
    q_rope_NHE: torch.Tensor,
    latent_NKR: torch.Tensor,
    rope_NKE: torch.Tensor,
    mine_NK: torch.Tensor,
    *,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA attention (latent values, MQA over one shared row per key) over the rows where ``mine_NK`` holds.

    Args:
        q_nope_NHR, q_rope_NHE: absorbed queries ``[N, H, R]`` and roped queries ``[N, H, E]``, floating.
        latent_NKR, rope_NKE: the selected rows ``[N, K, R]`` / ``[N, K, E]``, same dtype (rows that are not
            this rank's may hold anything finite: they are masked).
        mine_NK: bool ``[N, K]``, the rows this rank owns among the selected ones.
        softmax_scale: multiplies the logits (``1 / sqrt(R + E)`` in the reference model).

    Returns:
        ``(out_NHR, lse_NH)`` in the inputs' dtype; ``lse = -inf`` and ``out = 0`` for a query with no row here.
    """
    logits = torch.einsum("nhr,nkr->nhk", q_nope_NHR, latent_NKR) + torch.einsum("nhe,nke->nhk", q_rope_NHE, rope_NKE)
    mask = mine_NK[:, None, :]
    logits = (logits * softmax_scale).masked_fill(~mask, float("-inf"))
    lse_NH = torch.logsumexp(logits, dim=-1)
    p = torch.exp(logits - lse_NH[..., None])  # NaN where a query has no row here: masked next
    p = torch.where(mask, p, torch.zeros_like(p))
    return torch.einsum("nhk,nkr->nhr", p, latent_NKR), lse_NH


def combine_partials(out_CNHR: torch.Tensor, lse_CNH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``C`` partials in order ``c = 0, 1, ...``: ``(out_NHR, lse_NH)`` (pure; what every rank computes).

    A partial with ``lse = -inf`` weighs nothing; if every partial of a query is empty the result is zeros and
    ``-inf``.
    """
    lse_max = lse_CNH.amax(dim=0)
    finite = torch.isfinite(lse_max)
    base = torch.where(finite, lse_max, torch.zeros_like(lse_max))
    w_CNH = torch.exp(lse_CNH - base)  # exp(-inf) = 0 for empty partials
    total_NH = w_CNH.sum(dim=0)
    out = (w_CNH[..., None] * out_CNHR).sum(dim=0)
    nonempty = total_NH > 0
    out = torch.where(
        nonempty[..., None], out / torch.where(nonempty, total_NH, torch.ones_like(total_NH))[..., None], 0
    )
    lse = torch.where(nonempty, base + torch.log(total_NH), torch.full_like(base, float("-inf")))
    return out, lse


def merge_partials(
    out_NHR: torch.Tensor, lse_NH: torch.Tensor, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather every rank's partial and merge them (collective over ``group``; identity for one process).

    Args:
        out_NHR: this rank's partial output ``[N, H, R]``, float32 or float64.
        lse_NH: its log-sum-exp ``[N, H]``, same dtype (it travels in the same message).
        group: the CP group (``None``: one process).

    Returns:
        ``(out_NHR, lse_NH)`` merged over the group, identical on every rank.
    """
    if out_NHR.dtype != lse_NH.dtype or out_NHR.dtype not in (torch.float32, torch.float64):
        raise TypeError(
            "out_NHR and lse_NH must share a float32 or float64 dtype (one message carries both), "
            f"got {out_NHR.dtype} and {lse_NH.dtype}"
        )
    cp = group_size(group)
    if cp == 1:
        return out_NHR, lse_NH
    n, h, r = out_NHR.shape
    packed = torch.cat((out_NHR.reshape(n, h * r), lse_NH), dim=1)
    gathered = all_gather_rows(packed, group).view(cp, n, h * r + h)
    return combine_partials(gathered[..., : h * r].reshape(cp, n, h, r), gathered[..., h * r :])
