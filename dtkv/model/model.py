"""The tiny DSA reference model: MLA latent attention over indexer-selected top-k history tokens.

Shape legend: ``N`` tokens (rows), ``S`` key positions of one request, ``H`` attention heads, ``R`` latent dims
(``kv_lora_rank``), ``E`` rope dims, ``I`` indexer heads, ``J`` indexer dims, ``D`` ``d_model``, ``V`` vocab.

All arithmetic runs in float64 and is rounded to the stored dtype (bf16 KV rows, fp8 pages, float32 hidden
state). Every op is row-wise or a per-request reduction, so a token's result does not depend on how the batch
is cut across ranks except through float64 summation order (relative error ~1e-16, far below the float32 and
bf16 rounding steps): this is what lets CP runs match the single-process run to the last bit in practice, and
what the parity tests' tolerances rest on.

That summation order does depend on the batch: a BLAS GEMM picks its kernel by the number of rows (MKL computes
the rows past the last multiple of 4 with another kernel), so a row of a float64 ``x @ w`` can differ in its last
bits with the rows that share the call. The roundings above hide this for everything that is stored; the logits,
the one float64 result that leaves the model, use :func:`_matmul_fixed_order` instead, so a token's logits do not
depend on which other requests share its step (what prefix-cache parity compares).
"""

from __future__ import annotations

import math

import torch

from dtkv.attention import AttentionBackend, AttentionSpec
from dtkv.decode.topk import selection_keys
from dtkv.layouts import MLAFp8Layout, MLALatentLayout
from dtkv.model.config import ModelConfig
from dtkv.ops.indexer_logits import indexer_topk
from dtkv.ops.sparse_mla import sparse_mla_torch

__all__ = ["SELECT_BLOCK_BYTES", "TinyDSA", "attention_spec"]

F64 = torch.float64
SELECT_BLOCK_BYTES = 1 << 28
"""The indexer's temporaries per block of queries in :meth:`TinyDSA.select` (``[B, I, S]`` float64 products,
``[B, S]`` keys)."""


def _rms_norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _matmul_fixed_order(x_NK: torch.Tensor, w_KV: torch.Tensor) -> torch.Tensor:
    """``x_NK @ w_KV`` summed in the order ``k = 0, 1, ..., K-1`` for every output, whatever ``N`` is.

    Elementwise multiplies and adds only, so each output is the same sequence of IEEE operations on any device and
    for any number of rows (``N`` small here: one row per request of a step).
    """
    acc = x_NK[:, 0, None] * w_KV[0]
    for k in range(1, x_NK.shape[1]):
        acc = acc + x_NK[:, k, None] * w_KV[k]
    return acc


def _rope(x_NXE: torch.Tensor, pos_N: torch.Tensor) -> torch.Tensor:
    """Rotary embedding over the last dim (pairs ``(2i, 2i+1)``), absolute positions ``pos_N``."""
    e = x_NXE.shape[-1]
    if e == 0:
        return x_NXE
    inv = 1.0 / (10000.0 ** (torch.arange(0, e, 2, dtype=F64, device=x_NXE.device) / e))
    ang = pos_N.to(F64)[:, None] * inv[None, :]  # [N, E/2]
    while ang.dim() < x_NXE.dim():
        ang = ang.unsqueeze(1)
    cos, sin = torch.cos(ang), torch.sin(ang)
    x0, x1 = x_NXE[..., 0::2], x_NXE[..., 1::2]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)


def attention_spec(cfg: ModelConfig) -> AttentionSpec:
    """What the model's sparse attention looks like to a backend (:mod:`dtkv.attention`)."""
    layout = cfg.kv_layout
    assert isinstance(layout, (MLALatentLayout, MLAFp8Layout)), f"an MLA layout, got {layout!r}"
    return AttentionSpec(num_heads=cfg.num_heads, layout=layout, topk=cfg.index_topk)


class TinyDSA:
    """Deterministic seeded weights and the per-layer math of the reference model.

    The model does not own a KV cache: :class:`dtkv.runtime.Runtime` (through :class:`dtkv.model.ReferenceAdapter`)
    moves rows between these functions and the (sharded or replicated) pools.
    """

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu") -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        g = torch.Generator().manual_seed(cfg.seed)
        d, h, r, e = cfg.d_model, cfg.num_heads, cfg.kv_lora_rank, cfg.rope_dim
        i, j = cfg.index_heads, cfg.index_head_dim

        def w(*shape: int, fan_in: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=g, dtype=F64) / math.sqrt(fan_in)).to(self.device)

        self.embed = w(cfg.vocab_size, d, fan_in=1)
        self.layers = []
        for _ in range(cfg.num_layers):
            self.layers.append(
                {
                    "q_nope": w(d, h * r, fan_in=d),
                    "q_rope": w(d, h * e, fan_in=d),
                    "dkv": w(d, r, fan_in=d),
                    "kr": w(d, e, fan_in=d),
                    "o": w(h * r, d, fan_in=h * r),
                    "iq": w(d, i * j, fan_in=d),
                    "ik": w(d, j, fan_in=d),
                    "iw": w(d, i, fan_in=d),
                    "up": w(d, 2 * d, fan_in=d),
                    "down": w(2 * d, d, fan_in=2 * d),
                }
            )
        self.lm_head = w(d, cfg.vocab_size, fan_in=d)

    # ------------------------------------------------------------------------------------------ rows
    def embed_tokens(self, ids_N: torch.Tensor) -> torch.Tensor:
        """Token ids ``[N]`` -> hidden float32 ``[N, D]``."""
        return self.embed[ids_N.to(self.device)].to(torch.float32)

    def project(self, layer: int, h_ND: torch.Tensor, pos_N: torch.Tensor) -> dict[str, torch.Tensor]:
        """The rows one layer produces for its tokens.

        Returns:
            ``kv`` bf16 ``[N, R + E]`` (latent then roped key: the row the KV cache stores), ``index_k`` bf16
            ``[N, J]``, and the float64 queries ``q_nope`` ``[N, H, R]``, ``q_rope`` ``[N, H, E]``,
            ``iq`` ``[N, I, J]``, ``iw`` ``[N, I]``.
        """
        cfg, wl = self.cfg, self.layers[layer]
        x = _rms_norm(h_ND.to(F64))
        n = x.shape[0]
        kv = torch.cat((x @ wl["dkv"], _rope(x @ wl["kr"], pos_N)), dim=-1).to(torch.bfloat16)
        return {
            "kv": kv,
            "index_k": (x @ wl["ik"]).to(torch.bfloat16),
            "q_nope": (x @ wl["q_nope"]).view(n, cfg.num_heads, cfg.kv_lora_rank),
            "q_rope": _rope((x @ wl["q_rope"]).view(n, cfg.num_heads, cfg.rope_dim), pos_N),
            "iq": (x @ wl["iq"]).view(n, cfg.index_heads, cfg.index_head_dim),
            "iw": x @ wl["iw"],
        }

    def attend(
        self,
        q: dict[str, torch.Tensor],
        pos_N: torch.Tensor,
        keys_SC: torch.Tensor,
        index_keys_SJ: torch.Tensor,
    ) -> torch.Tensor:
        """Sparse attention of ``N`` queries of one request over its first ``S`` key positions.

        The indexer scores ``sum_i iw[n, i] * relu(iq[n, i] . k[s])`` for causal keys ``s <= pos[n]``, keeps the
        top ``index_topk`` (:meth:`select`), and attention runs over those latent rows only
        (:meth:`attend_selected`).

        Args:
            q: the query entries of :meth:`project`, sliced to the ``N`` rows.
            pos_N: positions of the queries (int64).
            keys_SC: float64 ``[S, R + E]`` stored rows of key positions ``0..S-1`` (dequantized).
            index_keys_SJ: float64 ``[S, J]`` stored indexer keys (dequantized).

        Returns:
            float64 ``[N, H * R]``.
        """
        top_idx_NK, valid_NK = self.select(q, pos_N, index_keys_SJ)
        return self.attend_selected(q, keys_SC, top_idx_NK, valid_NK)

    def select(
        self, q: dict[str, torch.Tensor], pos_N: torch.Tensor, index_keys_SJ: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The indexer's top-k of ``N`` queries over key positions ``0..S-1`` (the selection rule).

        Scores are rounded to float32; higher first, equal scores by lower position; non-causal keys never count.
        Scores and positions are packed into one int64 key (:func:`dtkv.decode.selection_keys`), so the top-k of
        the keys is that of a stable sort. The queries go in blocks whose ``[B, I, S]`` products and ``[B, S]``
        keys stay within :data:`SELECT_BLOCK_BYTES` (no ``[N, S]`` mask: each query's causal keys are a prefix).

        Args:
            q: needs ``iq`` ``[N, I, J]`` and ``iw`` ``[N, I]`` (float64).
            pos_N: positions of the queries (int64).
            index_keys_SJ: float64 ``[S, J]`` stored indexer keys (dequantized).

        Returns:
            ``(top_idx_NK, valid_NK)``: int64 key positions in selection order (``-1`` where not valid) and whether
            each is a real (causal) key, ``K = min(index_topk, S)``.
        """
        s, n, heads = index_keys_SJ.shape[0], pos_N.shape[0], q["iq"].shape[1]
        k = min(self.cfg.index_topk, s)
        if k == 0:
            empty = torch.zeros((n, 0), dtype=torch.int64, device=pos_N.device)
            return empty, empty.bool()
        cols = torch.arange(s, device=pos_N.device)
        block = max(1, SELECT_BLOCK_BYTES // max(1, (8 * heads + 48) * s))
        idx, valid = [], []
        for b0 in range(0, n, block):
            sl = slice(b0, min(n, b0 + block))
            score = (torch.relu(torch.einsum("nij,sj->nis", q["iq"][sl], index_keys_SJ)) * q["iw"][sl, :, None]).sum(1)
            # Selection must not depend on how the batch was cut: round to float32 so float64 summation-order noise
            # becomes an exact tie (duplicate tokens give equal indexer keys), and break ties by position.
            keys = selection_keys(score.to(torch.float32), cols.expand_as(score), cols[None, :] <= pos_N[sl, None])
            top, ok = indexer_topk(keys, k)
            idx.append(top)
            valid.append(ok)
        return torch.cat(idx), torch.cat(valid)

    def attend_selected(
        self, q: dict[str, torch.Tensor], keys_SC: torch.Tensor, top_idx_NK: torch.Tensor, valid_NK: torch.Tensor
    ) -> torch.Tensor:
        """MLA attention of ``N`` queries over the selected rows ``keys_SC[top_idx_NK]`` (invalid ones masked).

        The torch reference of :mod:`dtkv.attention` in float64 over already dequantized rows.

        Returns:
            float64 ``[N, H * R]``.
        """
        cfg = self.cfg
        idx = torch.where(valid_NK, top_idx_NK, torch.full_like(top_idx_NK, -1))
        out, _ = sparse_mla_torch(self.queries(q), keys_SC, idx, self.softmax_scale, cfg.kv_lora_rank, cfg.rope_dim, 0)
        return out.reshape(top_idx_NK.shape[0], -1)

    def attend_view(
        self,
        q: dict[str, torch.Tensor],
        pos_N: torch.Tensor,
        kv_pages: torch.Tensor,
        key_slots_S: torch.Tensor,
        index_keys_SJ: torch.Tensor,
        backend: AttentionBackend,
        schedule=None,
    ) -> torch.Tensor:
        """:meth:`attend` through an attention backend reading the stored pages themselves (no dequantized copy).

        The indexer's top-k (:meth:`select`) picks key positions; ``key_slots_S`` turns them into token slots of
        ``kv_pages`` (a full view or a pool, in the stored format), and ``backend`` (:mod:`dtkv.attention`) attends
        over those rows. The queries go in the backend's dtype (FlashMLA: bf16), the output comes back as float64.

        Args:
            q: the query entries of :meth:`project`, sliced to the ``N`` rows.
            pos_N: positions of the queries (int64).
            kv_pages: ``[V, page_size, row]`` the layer's stored MLA pages (view or pool).
            key_slots_S: int64 ``[S]`` token slot in ``kv_pages`` of key positions ``0..S-1``.
            index_keys_SJ: float64 ``[S, J]`` stored indexer keys (dequantized).
            backend: from :func:`dtkv.attention.resolve_attention` for this model's :class:`AttentionSpec`.
            schedule: a decode step's schedule (:meth:`dtkv.runtime.StepContext.decode_schedule` for these ``N``
                queries and the index width): the backend's decode kernel instead of its prefill kernel.

        Returns:
            float64 ``[N, H * R]``.
        """
        top_idx_NK, valid_NK = self.select(q, pos_N, index_keys_SJ)
        slots = torch.where(valid_NK, key_slots_S[top_idx_NK.clamp(min=0)], torch.full_like(top_idx_NK, -1))
        idx = backend.indices(slots, kv_pages)
        qs, scale = backend.cast_queries(self.queries(q)), self.softmax_scale
        if schedule is not None:
            out, _ = backend.decode(qs, kv_pages, idx, softmax_scale=scale, schedule=schedule)
        else:
            out, _ = backend.prefill(qs, kv_pages, idx, softmax_scale=scale)
        return out.to(F64).reshape(top_idx_NK.shape[0], -1)

    @property
    def softmax_scale(self) -> float:
        """Logit scale of the latent attention: ``1 / sqrt(R + E)``."""
        return 1.0 / math.sqrt(self.cfg.kv_lora_rank + self.cfg.rope_dim)

    @staticmethod
    def queries(q: dict[str, torch.Tensor]) -> torch.Tensor:
        """The attention query of :mod:`dtkv.attention`: ``[N, H, R + E]`` (``q_nope`` then ``q_rope``)."""
        return torch.cat((q["q_nope"], q["q_rope"]), dim=-1)

    def finish_layer(self, layer: int, h_ND: torch.Tensor, attn_NX: torch.Tensor) -> torch.Tensor:
        """Output projection, residual and MLP: the next hidden state (float32 ``[N, D]``)."""
        wl = self.layers[layer]
        h = h_ND.to(F64) + attn_NX @ wl["o"]
        h = h + torch.nn.functional.silu(_rms_norm(h) @ wl["up"]) @ wl["down"]
        return h.to(torch.float32)

    def logits(self, h_ND: torch.Tensor) -> torch.Tensor:
        """float32 hidden ``[N, D]`` -> float64 logits ``[N, V]``; each row independent of the others, bit for bit."""
        return _matmul_fixed_order(_rms_norm(h_ND.to(F64)), self.lm_head)
