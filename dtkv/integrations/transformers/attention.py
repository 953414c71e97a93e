"""The replacement attention of a DSA layer: the model's own projections, dtkv's KV storage and top-k path.

Shape legend: ``N`` this rank's query rows, ``H`` attention heads, ``R`` latent dims (``kv_lora_rank``), ``E``
rope dims, ``I`` indexer heads, ``J`` indexer dims, ``K`` key-table entries, ``k`` keys kept per query
(``min(index_topk, K)``), ``V`` view token slots, ``D`` hidden size.

:func:`dsa_attention` runs one layer for this rank's rows, calling the attention module's own submodules as
the transformers forward does (``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``, ``kv_a_proj_with_mqa``,
``kv_a_layernorm``, the family's rope functions, the indexer's ``wq_b``/``wk``/``k_norm``/``weights_proj``,
``expand_kv`` (``kv_b_proj``) and ``o_proj``). Only two things differ from the transformers forward:

1. KV storage: the latent row ``[kv_a_layernorm(kv), rope(k_rot)]`` and the indexer key are written into
   dtkv's sharded pools (direct or owner-filtered writes, fused fp8 quantization) and read back from a
   materialized full view, instead of the model's dense ``DynamicCache`` of expanded keys and values.
2. Top-k: the indexer scores each query against its own request's keys in position order and keeps the
   ``index_topk`` best with a *stable* sort (ties go to the lowest position, see
   :mod:`dtkv.integrations.transformers`), as logical token locations remapped into the view
   (:func:`dtkv.ops.remap`); attention then runs over the selected latent rows only.

:func:`install` binds it as ``forward`` of every attention module (the original forward still runs whenever
no step is active), :func:`uninstall` restores the class forward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dtkv import _env, ops
from dtkv._collectives import all_gather_rows
from dtkv.attention import AttentionBackend
from dtkv.debug import check_write_ownership
from dtkv.integrations.transformers._family import DSAFamily, DSAGeometry
from dtkv.integrations.transformers._kvio import read_rows, write_rows
from dtkv.integrations.transformers._plan import StepPlan
from dtkv.layouts import KVLayout
from dtkv.materialize import Materializer, check_view, gather_view
from dtkv.ownership import OwnershipSpec, PageOwnership
from dtkv.pool import ShardedKVPool

__all__ = ["AttentionContext", "check_unbound", "dsa_attention", "install", "uninstall"]


class AttentionContext:
    """What the replacement attention of every layer reads: pools, page map, KV mode and the current step.

    One per :class:`dtkv.integrations.transformers.DSAModelRunner`; :attr:`plan` is set for the duration of a
    step (``None`` otherwise: the modules then run their original forward).
    """

    def __init__(
        self,
        *,
        pool: ShardedKVPool,
        layouts: dict[str, KVLayout],
        ownership: PageOwnership,
        rank: int,
        group: dist.ProcessGroup | None,
        mode: str,
        family: DSAFamily,
        geometry: DSAGeometry,
        attention: AttentionBackend | None = None,
    ) -> None:
        self.pool, self.layouts, self.ownership, self.rank, self.group = pool, layouts, ownership, rank, group
        self.spec: OwnershipSpec = ownership.spec  # plain ints: what compiled code passes to the ops
        self.mode, self.family, self.geometry = mode, family, geometry
        self.page_size = next(iter(layouts.values())).page_size
        self.mla_rope = family.mla_rope
        self.indexer_rope = family.indexer_rope
        self.plan: StepPlan | None = None
        self.materializer: Materializer | None = None
        self.attention = attention
        """The attention backend (:mod:`dtkv.attention`); None or ``torch``: the expanded form below."""

    # ------------------------------------------------------------------------------------------ writes
    def _gather(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        """Rank-major all-gather of ``x`` padded to ``rows`` rows: ``[cp * rows, ...]``."""
        padded = x.new_zeros((rows, *x.shape[1:]))
        padded[: x.shape[0]] = x
        return all_gather_rows(padded, self.group)

    def write(self, name: str, layer: int, rows: torch.Tensor) -> None:
        """Store this rank's rows ``[N, C]`` of ``layer`` (collective in the sharded modes)."""
        plan, lay = self.plan, self.layouts[name]
        pool = self.pool.local(name, layer)
        if self.mode == "single":
            write_rows(pool, lay, rows, plan.locs, self.spec, 0, direct=False)
        elif self.mode == "sharded":
            gathered = self._gather(rows, plan.max_local)
            write_rows(pool, lay, gathered, plan.locs_gathered, self.spec, self.rank, direct=False)
        else:
            locs = plan.locs[plan.direct_rows]
            if _env.debug_enabled():
                check_write_ownership(
                    locs, self.ownership, self.rank, self.page_size, self.group,
                    what=f"direct write of {name!r}, layer {layer}",
                )  # fmt: skip
            write_rows(pool, lay, rows[plan.direct_rows], locs, self.spec, self.rank, direct=True)
            if plan.max_handoff:
                gathered = self._gather(rows[plan.handoff_rows], plan.max_handoff)
                write_rows(pool, lay, gathered, plan.handoff_locs_gathered, self.spec, self.rank, direct=False)

    # ------------------------------------------------------------------------------------------ reads
    def views(self, layer: int, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """``layer``'s full views (name -> ``[num_view_pages, *page_shape]``); call after the layer's writes."""
        plan = self.plan
        if plan.mat_plan is None:
            return {n: self.pool.local(n, layer) for n in names}
        if self.materializer is not None:
            self.materializer.prefetch(layer + 1)  # the next layer's history gather overlaps this layer
            return self.materializer.view(layer)
        views = {n: gather_view(self.pool.local(n, layer), plan.mat_plan, self.group) for n in names}
        if _env.debug_enabled():
            check_view(self.pool, layer, plan.mat_plan, views)
        return views


def _indexer_rows(indexer, hidden_1ND, q_resid_1NQ, cos, sin, rope):
    """The indexer's query ``[N, I, J]``, key ``[N, J]`` and head weights ``[N, I]`` (float32), as transformers."""
    n = hidden_1ND.shape[1]
    e = indexer.qk_rope_head_dim
    q = indexer.wq_b(q_resid_1NQ).view(1, n, indexer.n_heads, indexer.head_dim)
    q_rot, q_pass = torch.split(q, [e, indexer.head_dim - e], dim=-1)
    k = indexer.k_norm(indexer.wk(hidden_1ND)).unsqueeze(2)  # [1, N, 1, J]
    k_rot, k_pass = torch.split(k, [e, indexer.head_dim - e], dim=-1)
    q_rot, k_rot = rope(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)[0]
    k = torch.cat([k_rot, k_pass], dim=-1)[0, :, 0]
    w = indexer.weights_proj(hidden_1ND.to(indexer.weights_proj.weight.dtype)).float() * (indexer.n_heads**-0.5)
    return q, k, w[0]


def _select_topk(indexer, ctx: AttentionContext, q_NIJ, w_NI, keys_KJ) -> torch.Tensor:
    """View slots ``[N, k]`` (int64, ``-1`` = none) of each query's top-k keys; ties go to the lower position."""
    plan = ctx.plan
    scores = torch.matmul(q_NIJ.float(), keys_KJ.transpose(0, 1).float()) * indexer.softmax_scale  # [N, I, K]
    scores = torch.relu(scores)
    index_NK = torch.matmul(w_NI.unsqueeze(-2), scores).squeeze(-2)
    visible = (plan.key_req[None, :] == plan.req_idx[:, None]) & (plan.key_pos[None, :] <= plan.positions[:, None])
    index_NK = index_NK.masked_fill(~visible, float("-inf"))
    k = min(indexer.index_topk, index_NK.shape[-1])
    top_val, top_col = torch.sort(index_NK, dim=-1, descending=True, stable=True)
    top_val, top_col = top_val[:, :k], top_col[:, :k]
    locs = torch.where(top_val > float("-inf"), plan.key_locs[top_col], torch.full_like(top_col, -1))
    if plan.mat_plan is None:
        return locs
    return ops.remap(locs, plan.mat_plan.page_map, page_size=ctx.page_size)


def dsa_attention(attn, ctx: AttentionContext, hidden_states: torch.Tensor, position_embeddings, prev_topk=None):
    """One DSA layer's attention for this rank's rows (run phase: tensors only, compiles with fullgraph).

    Args:
        attn: the model's attention module (``DeepseekV32Attention`` / ``GlmMoeDsaAttention``).
        ctx: the runner's :class:`AttentionContext` with an active plan.
        hidden_states: ``[1, N, D]`` normalized hidden states of the local rows (model dtype).
        position_embeddings: ``(cos, sin)`` ``[1, N, E]`` of the local rows' positions (the model's rotary
            embedding).
        prev_topk: ``[N, k]`` view slots of the previous layer's top-k, for GLM layers without an indexer.

    Returns:
        ``(out [1, N, D], topk_slots [N, k])``.
    """
    layer = attn.layer_idx
    n = hidden_states.shape[1]
    h, r, e = attn.num_heads, attn.kv_lora_rank, attn.qk_rope_head_dim
    cos, sin = position_embeddings
    q_resid = attn.q_a_layernorm(attn.q_a_proj(hidden_states))
    q = attn.q_b_proj(q_resid).view(1, n, h, attn.qk_head_dim).transpose(1, 2)  # [1, H, N, nope + E]
    q_pass, q_rot = torch.split(q, [attn.qk_nope_head_dim, e], dim=-1)
    kv_pass, k_rot = torch.split(attn.kv_a_proj_with_mqa(hidden_states), [r, e], dim=-1)
    k_pass = attn.kv_a_layernorm(kv_pass)  # [1, N, R]
    q_rot, k_rot = ctx.mla_rope(q_rot, k_rot.view(1, 1, n, e), cos, sin)
    query_HNC = torch.cat((q_pass, q_rot), dim=-1)[0]
    ctx.write("kv", layer, torch.cat((k_pass[0], k_rot[0, 0]), dim=-1))  # the latent row [N, R + E]
    indexer = attn.indexer
    if indexer is not None:
        iq, ik, iw = _indexer_rows(indexer, hidden_states, q_resid, cos, sin, ctx.indexer_rope)
        ctx.write("index", layer, ik)
        views = ctx.views(layer, ("index", "kv"))
        keys_KJ = read_rows(views["index"], ctx.layouts["index"], iq.dtype)[ctx.plan.key_slots]
        topk_NK = _select_topk(indexer, ctx, iq, iw, keys_KJ)
    else:
        if prev_topk is None:
            raise ValueError(f"layer {layer} shares the previous layer's top-k, but got prev_topk_indices=None")
        views = ctx.views(layer, ("kv",))
        topk_NK = prev_topk
    k = topk_NK.shape[1]
    if n == 0:  # no local rows (e.g. decode steps on other ranks): the collectives above were all this rank owed
        return attn.o_proj(hidden_states.new_zeros((1, 0, h * attn.v_head_dim))), topk_NK
    if ctx.attention is not None and ctx.attention.name != "torch":
        out = _absorbed_attention(attn, ctx.attention, query_HNC, views["kv"], topk_NK)
        return attn.o_proj(out.to(hidden_states.dtype).reshape(1, n, h * attn.v_head_dim)), topk_NK
    latent_VC = read_rows(views["kv"], ctx.layouts["kv"], hidden_states.dtype)
    sel = latent_VC[topk_NK.clamp(min=0)].reshape(1, 1, n * k, r + e)  # [1, 1, N*k, R + E]
    # the class's expand_kv (kv_b_proj), never an instance wrap such as the reference's key rounding
    key, value = type(attn).expand_kv(attn, sel[..., :r], sel[..., r:])  # [1, H, N*k, nope+E], [1, H, N*k, v]
    key = key.view(h, n, k, attn.qk_head_dim)
    value = value.view(h, n, k, attn.v_head_dim)
    # float32 inside, one rounding at the end: what SDPA kernels do for half-precision inputs
    logits_HNK = torch.einsum("hnc,hnkc->hnk", query_HNC.float(), key.float()) * attn.scaling
    logits_HNK = logits_HNK.masked_fill((topk_NK < 0)[None], float("-inf"))
    probs = torch.softmax(logits_HNK, dim=-1)
    out = torch.einsum("hnk,hnkv->nhv", probs, value.float()).to(hidden_states.dtype)
    return attn.o_proj(out.reshape(1, n, h * attn.v_head_dim)), topk_NK


def _absorbed_attention(attn, backend: AttentionBackend, query_HNC, kv_view, topk_NK) -> torch.Tensor:
    """MLA in the absorbed form through a :mod:`dtkv.attention` kernel: ``[N, H, v_head_dim]`` (float32 products).

    ``kv_b_proj``'s weight ``[H * (nope + v), R]`` is ``W_UK [H, nope, R]`` then ``W_UV [H, v, R]`` per head. The
    latent query is ``q_nope @ W_UK`` (``[N, H, R]``, then the rope query: ``[N, H, R + E]``), the kernel attends
    over the stored latent rows (keys: latent and rope; values: the latent), and ``W_UV`` maps its latent output to
    the value heads: the same attention as the expanded form, other roundings (FlashMLA: bf16 queries and keys).
    """
    h, nope, v = attn.num_heads, attn.qk_nope_head_dim, attn.v_head_dim
    r = attn.kv_lora_rank
    w = attn.kv_b_proj.weight.view(h, nope + v, r)
    q_lat = torch.einsum("hnd,hdr->nhr", query_HNC[..., :nope].float(), w[:, :nope].float())
    q = torch.cat((q_lat, query_HNC[..., nope:].transpose(0, 1).float()), dim=-1)  # [N, H, R + E]
    idx = backend.indices(topk_NK, kv_view)
    o_lat, _ = backend.prefill(backend.cast_queries(q), kv_view, idx, softmax_scale=attn.scaling)
    return torch.einsum("nhr,hvr->nhv", o_lat.float(), w[:, nope:].float())


def check_unbound(model: torch.nn.Module) -> None:
    """Raise ``ValueError`` if ``model``'s attention modules already have a bound forward (one runner at a time)."""
    if any("forward" in vars(layer.self_attn) for layer in model.model.layers):
        raise ValueError(
            "model's attention modules already have a bound forward (another DSAModelRunner wraps this model); "
            "close() that runner first"
        )


def install(model: torch.nn.Module, ctx: AttentionContext) -> None:
    """Bind :func:`dsa_attention` as ``forward`` of every attention module of ``model`` (instance attribute).

    While ``ctx.plan`` is None the module runs its original forward, so the model stays usable on its own.

    Raises:
        ValueError: the modules already have a bound forward (one runner per model at a time).
    """
    returns_topk = ctx.family.returns_topk
    check_unbound(model)
    for layer in model.model.layers:
        attn = layer.self_attn
        original = type(attn).forward.__get__(attn)

        def forward(*args, _attn=attn, _original=original, **kwargs):
            if ctx.plan is None:
                return _original(*args, **kwargs)
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            rope = kwargs["position_embeddings"] if "position_embeddings" in kwargs else args[1]
            out, topk = dsa_attention(_attn, ctx, hidden, rope, kwargs.get("prev_topk_indices"))
            return (out, None, topk) if returns_topk else (out, None)

        attn.forward = forward


def uninstall(model: torch.nn.Module) -> None:
    """Remove the bound forwards (the class forward applies again)."""
    for layer in model.model.layers:
        layer.self_attn.__dict__.pop("forward", None)
