"""The replacement attention of a DSA layer: the model's own projections, the runtime's KV storage and top-k path.

Shape legend: ``N`` this rank's query rows, ``H`` attention heads, ``R`` latent dims (``kv_lora_rank``), ``E``
rope dims, ``C`` query/key dims (``qk_nope_head_dim + E``), ``I`` indexer heads, ``J`` indexer dims, ``K``
key-table entries, ``k`` keys kept per query (``index_topk``, ``-1`` padded), ``D`` hidden size.

:func:`dsa_attention` runs one layer for this rank's rows, calling the attention module's own submodules as the
transformers forward does (``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``, ``kv_a_proj_with_mqa``,
``kv_a_layernorm``, the family's rope functions, the indexer's ``wq_b``/``wk``/``k_norm``/``weights_proj``,
``kv_b_proj`` and ``o_proj``). Everything it computes before touching the cache is one function of the module and
the rows, :func:`projections` (tensors in, tensors out): the adapter runs it compiled in decode steps
(``TransformersAdapter(compile_modules=)``), where its ropes, splits and concatenations are otherwise some thirty
small kernels a layer. What differs from the transformers forward:

1. KV storage: the latent row ``[kv_a_layernorm(kv), rope(k_rot)]`` and the indexer key are stored by the runtime
   (:meth:`dtkv.runtime.StepContext.write`: direct or owner-filtered writes, fused fp8 quantization) instead of the
   model's dense ``DynamicCache`` of expanded keys and values.
2. Extend steps (prefill, full-view decode): the indexer scores each query against its own request's keys of the
   step's key table (its request's entries up to its position: one column range per query, no dense mask) and keeps
   the ``index_topk`` best as view slots (``-1`` padded), block of queries by block of queries so that memory stays
   bounded whatever the chunk (:func:`select_topk`). The tie rule is the stable lowest-position one (see
   :mod:`dtkv.integrations.transformers`): score and position travel packed in one int64 key
   (:func:`dtkv.decode.selection_keys`' order), whose ``torch.topk`` *is* a stable descending sort. On the ``torch``
   backend (the parity reference) the scores are the model's own float32 formula; on ``triton`` and ``flashmla``
   with fp8 index pages the indexer is DeepSeek-V3.2's fp8 one: fp8 queries (per (query, head) scale folded into the
   head weight, :func:`dtkv.ops.quantize_indexer_queries`) against the fp8 keys of the view in one kernel
   (:func:`dtkv.ops.indexer_logits`, float32 logits, ``-inf`` outside each query's range), then
   :func:`dtkv.ops.logits_topk` (the packed keys' selection, bit for bit, at half their bytes; a full-view decode
   bucket keeps the packed keys). bf16/fp32 index rows take the exact formula on every backend.
   :func:`indexer_precision` switches this (``"fp8"``: the fp8 math on the ``torch`` backend too, what checks a
   fast run on a CPU), :func:`uses_fp8_indexer` says which a run takes, and the parity reference mirrors it
   (``reference_logits(..., fp8_indexer=True)``). Attention runs over the selected latent rows: expanded by
   ``kv_b_proj`` as the model does (``torch`` backend), or in the absorbed form through the runtime's attention
   backend (``triton``, ``flashmla``: ``q_nope`` through ``kv_b_proj``'s key half into the latent, the output through
   its value half, each product writing in place into the kernel's query and ``o_proj``'s input; the two halves are
   taken once per bind, in the dtype the backend takes queries in or the weight's where wider:
   :class:`AbsorbedWeights`).
3. Sharded decode steps: the queries are absorbed into the latent space (``q_nope @ W_UK`` per head, the MLA
   identity) and the runtime attends where the pages are (:meth:`dtkv.runtime.StepContext.decode_attention`: exact
   global top-k, LSE merge of the ranks' partials); the merged latent output is expanded by ``W_UV`` and ``o_proj``.
   The indexer queries are those of the extend steps' indexer (rounded by :func:`fp8_indexer_queries` where it is
   the fp8 one), so both decode modes select alike.

Every contraction of the ``torch`` backend is a ``torch.matmul``, so :func:`dtkv.runtime.batch_invariant` covers it
(the fp8 indexer kernel computes each query on its own). :func:`install` binds
:func:`dsa_attention` as ``forward`` of every attention module (the original forward runs whenever no step is
active), :func:`uninstall` restores the class forward.
"""

from __future__ import annotations

import torch

from dtkv import ops
from dtkv.decode import DecodeQueries
from dtkv.integrations.transformers._family import FAMILIES
from dtkv.integrations.transformers._indexer import (
    FP8_BLOCK_BYTES,
    INDEXER_PRECISIONS,
    TORCH_BLOCK_BYTES,
    fp8_indexer_queries,
    indexer_precision,
    select_topk,
    uses_fp8_indexer,
)
from dtkv.kvio import read_rows
from dtkv.ops.rope_interleave_into import IN_DTYPES as ROPE_DTYPES
from dtkv.runtime import StepContext

__all__ = [
    "FP8_BLOCK_BYTES",
    "INDEXER_PRECISIONS",
    "TORCH_BLOCK_BYTES",
    "AbsorbedWeights",
    "check_unbound",
    "dsa_attention",
    "fp8_indexer_queries",
    "fuses_query_rope",
    "indexer_precision",
    "install",
    "projections",
    "select_topk",
    "uninstall",
    "uses_fp8_indexer",
]

_ROPES: dict[type, tuple] = {}
"""Attention class -> its family's ``(mla_rope, indexer_rope)`` (filled by :func:`install`, outside compiled code)."""
_SHARES: dict[type, bool] = {}
"""Attention class -> whether its family's layers may reuse the previous layer's selection (GLM-5)."""


def _ropes(attn) -> tuple:
    ropes = _ROPES.get(type(attn))
    if ropes is None:
        module = type(attn).__module__
        fam = next((f for f in FAMILIES.values() if f.module == module), None)
        if fam is None:
            raise TypeError(f"attn must be the attention module of a transformers DSA model, got {type(attn).__name__}")
        ropes = _ROPES[type(attn)] = (fam.mla_rope, fam.indexer_rope)
        _SHARES[type(attn)] = fam.returns_topk
    return ropes


def _indexer_rows(indexer, hidden_1ND, q_resid_1NQ, cos, sin, rope, k_lin=None, w_lin=None):
    """The indexer's query ``[N, I, J]``, key ``[N, J]`` and head weights ``[N, I]`` (float32), as transformers;
    ``k_lin`` / ``w_lin``: ``wk``'s / ``weights_proj``'s output where the fused input projection computed it."""
    n = hidden_1ND.shape[1]
    e = indexer.qk_rope_head_dim
    q = indexer.wq_b(q_resid_1NQ).view(1, n, indexer.n_heads, indexer.head_dim)
    q_rot, q_pass = torch.split(q, [e, indexer.head_dim - e], dim=-1)
    k = indexer.k_norm(indexer.wk(hidden_1ND) if k_lin is None else k_lin).unsqueeze(2)  # [1, N, 1, J]
    k_rot, k_pass = torch.split(k, [e, indexer.head_dim - e], dim=-1)
    q_rot, k_rot = rope(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)[0]
    k = torch.cat([k_rot, k_pass], dim=-1)[0, :, 0]
    if w_lin is None:
        w_lin = indexer.weights_proj(hidden_1ND.to(indexer.weights_proj.weight.dtype))
    w = w_lin.float() * (indexer.n_heads**-0.5)
    return q, k, w[0]


def projections(
    attn,
    hidden_states: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    mla_rope,
    indexer_rope,
    fused=None,
    *,
    rope_query: bool = True,
):
    """One layer's rows before any cache access, as the transformers forward computes them (tensors only: what the
    adapter compiles for decode steps, one graph for every layer of a class).

    Args:
        attn: the attention module; hidden_states ``[1, N, D]``; cos, sin ``[1, N, E]``; mla_rope, indexer_rope:
            the family's rope functions (:func:`_ropes`).
        fused: ``None``, or the weights of the projections that read ``hidden_states`` as one ``[sum(out), D]``
            tensor (:meth:`AbsorbedWeights.input_weight`: ``q_a_proj``, ``kv_a_proj_with_mqa``, then the
            indexer's ``wk`` and ``weights_proj`` where they share its dtype), run as one GEMM and split: the same
            products, one launch and one pass over ``hidden_states`` instead of up to four.
        rope_query: ``False`` leaves ``q_rot`` unrotated (the caller writes its rope where it is read:
            :func:`dtkv.ops.rope_interleave_into`); the key's rope is applied either way.

    Returns:
        ``(q_pass [1, H, N, nope], q_rot [1, H, N, E], latent [N, R + E], index)``: the query halves (``q_rot``
        rotated unless ``rope_query`` is ``False``), the latent row to store (``[kv_a_layernorm(kv),
        rope(k_rot)]``), and ``index`` the indexer's ``(query [N, I, J], key [N, J], head weights [N, I]
        float32)`` or ``None`` for a layer without an indexer.
    """
    n = hidden_states.shape[1]
    h, r, e = attn.num_heads, attn.kv_lora_rank, attn.qk_rope_head_dim
    k_lin = w_lin = None
    if fused is None:
        q_lin, kv_lin = attn.q_a_proj(hidden_states), attn.kv_a_proj_with_mqa(hidden_states)
    else:
        sizes = [m.out_features for m in _input_linears(attn)]
        parts = torch.split(torch.nn.functional.linear(hidden_states, fused), sizes[: _fused_count(sizes, fused)], -1)
        q_lin, kv_lin, k_lin, w_lin = (*parts, None, None)[:4]
    q_resid = attn.q_a_layernorm(q_lin)
    q = attn.q_b_proj(q_resid).view(1, n, h, attn.qk_head_dim).transpose(1, 2)  # [1, H, N, nope + E]
    q_pass, q_rot = torch.split(q, [attn.qk_nope_head_dim, e], dim=-1)
    kv_pass, k_rot = torch.split(kv_lin, [r, e], dim=-1)
    k_pass = attn.kv_a_layernorm(kv_pass)  # [1, N, R]
    if rope_query:
        q_rot, k_rot = mla_rope(q_rot, k_rot.view(1, 1, n, e), cos, sin)
    else:  # the key alone (the function rotates two tensors: the key's one head twice, 128 bytes a token)
        k_rot = mla_rope(k_rot.view(1, 1, n, e), k_rot.view(1, 1, n, e), cos, sin)[1]
    latent = torch.cat((k_pass[0], k_rot[0, 0]), dim=-1)
    index = None
    if attn.indexer is not None:
        index = _indexer_rows(attn.indexer, hidden_states, q_resid, cos, sin, indexer_rope, k_lin, w_lin)
    return q_pass, q_rot, latent, index


def _input_linears(attn) -> list:
    """The projections that read a layer's hidden states, in the fused weight's order."""
    mods = [attn.q_a_proj, attn.kv_a_proj_with_mqa]
    if attn.indexer is not None:
        mods += [attn.indexer.wk, attn.indexer.weights_proj]
    return mods


def _fused_count(sizes: list[int], fused: torch.Tensor) -> int:
    """How many of :func:`_input_linears` a fused weight of ``fused.shape[0]`` rows holds (a prefix of them)."""
    total = 0
    for i, size in enumerate(sizes):
        total += size
        if total == fused.shape[0]:
            return i + 1
    raise ValueError(f"fused must stack a prefix of the input projections ({sizes} rows), got {fused.shape[0]} rows")


class AbsorbedWeights:
    """``kv_b_proj``'s two halves of one attention module for the absorbed form, taken once per bind.

    ``kv_b_proj.weight`` ``[H * (nope + v), R]`` is ``W_UK [H, nope, R]`` then ``W_UV [H, v, R]`` per head.
    :meth:`get` gives ``(W_UK [H, nope, R], W_UV^T [H, R, v])`` in a dtype: views of the weight itself where it has
    that dtype already, else one converted copy per dtype, kept until the module is unbound
    (:func:`uninstall`). A weight replaced while bound is not seen (bind again); one changed in place is.
    """

    def __init__(self, attn) -> None:
        self.attn = attn
        self.weight_dtype: torch.dtype = attn.kv_b_proj.weight.dtype
        """The weight's dtype at the bind."""
        self._by_dtype: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        self._fused: torch.Tensor | None = None
        self._rows: list[tuple[int, int]] = []

    def get(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(W_UK, W_UV^T)`` in ``dtype`` (computed at the first call for that dtype)."""
        got = self._by_dtype.get(dtype)
        if got is None:
            got = self._by_dtype[dtype] = _absorbed_factors(self.attn, dtype)
        return got

    def input_weight(self) -> torch.Tensor | None:
        """The input projections' weights as one tensor (:func:`projections`' ``fused``), or ``None`` where fewer
        than two of them fuse.

        :func:`_input_linears` in order, as long as each is a plain ``nn.Linear`` without bias of the first's dtype
        and device (a quantized module, or the indexer's float32 ``weights_proj`` of a loaded checkpoint, ends the
        prefix). No copy is kept: at the first call the weights move into one buffer and each module's weight
        becomes a view of its rows (the same values and ``Parameter`` objects; the module computes as before, a
        change in place is seen by both). A weight given new storage since (``model.to(...)``, a replaced
        ``Parameter``) is found at the next call and the buffer is built again.
        """
        mods = _input_linears(self.attn)
        fused = self._fused
        if fused is not None and all(
            m.weight.data_ptr() == fused[a].data_ptr() and m.weight.shape == (b - a, fused.shape[1])
            for m, (a, b) in zip(mods, self._rows)
        ):
            return fused
        self._fused, self._rows = None, []
        first = mods[0].weight
        take = []
        for m in mods:
            w = getattr(m, "weight", None)
            plain = type(m) is torch.nn.Linear and m.bias is None and isinstance(w, torch.nn.Parameter)
            if not (plain and w.dtype == first.dtype and w.device == first.device and w.shape[1] == first.shape[1]):
                break
            take.append(m)
        if len(take) < 2:
            return None
        with torch.no_grad():
            fused = torch.cat([m.weight.detach() for m in take])
            a = 0
            for m in take:
                b = a + m.weight.shape[0]
                m.weight.data = fused[a:b]
                self._rows.append((a, b))
                a = b
        self._fused = fused
        return fused


def _absorbed_factors(attn, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    h, nope, v, r = attn.num_heads, attn.qk_nope_head_dim, attn.v_head_dim, attn.kv_lora_rank
    w = attn.kv_b_proj.weight.detach().to(dtype).view(h, nope + v, r)
    return w[:, :nope], w[:, nope:].transpose(1, 2)


def _factors(attn, absorbed: AbsorbedWeights | None, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return absorbed.get(dtype) if absorbed is not None else _absorbed_factors(attn, dtype)


def _backend_dtype(backend, attn, absorbed: AbsorbedWeights | None = None) -> torch.dtype:
    """The dtype the absorbed products run in: what the backend takes float32 queries as (FlashMLA: bf16), or the
    weight's dtype where that is wider (a float32 model keeps float32 products on every backend)."""
    weight = absorbed.weight_dtype if absorbed is not None else attn.kv_b_proj.weight.dtype
    return torch.promote_types(backend.cast_queries(torch.zeros((), dtype=torch.float32)).dtype, weight)


def _extend_attention(attn, ctx, hidden_states, q_pass, q_rot, index, prev_topk, absorbed=None, rope=None):
    """Prefill / full-view decode: the model's own top-k and the attention over the step's full views (expanded on
    the ``torch`` backend, absorbed on the others); ``q_pass`` ``[H, N, nope]``, ``q_rot`` ``[H, N, E]``, ``index``
    the indexer's rows (:func:`projections`); ``rope``: ``(cos, sin)`` ``[N, E]`` where ``q_rot`` is still to be
    rotated (absorbed backends only: :func:`_absorbed_attention` writes it rotated into its query buffer)."""
    layer, n = attn.layer_idx, hidden_states.shape[1]
    h, r, e = attn.num_heads, attn.kv_lora_rank, attn.qk_rope_head_dim
    indexer = attn.indexer
    if indexer is not None:
        iq, ik, iw = index
        ctx.write("index", layer, ik)
        views = ctx.views(layer, ("index", "kv"))
        topk_NK = select_topk(indexer, ctx, iq, iw, views["index"])
    else:
        if prev_topk is None:
            raise ValueError(f"layer {layer} shares the previous layer's top-k, but got prev_topk_indices=None")
        views = ctx.views(layer, ("kv",))
        topk_NK = prev_topk
    k = topk_NK.shape[1]
    if n == 0:  # no local rows (e.g. decode steps on other ranks): the collectives above were all this rank owed
        return attn.o_proj(hidden_states.new_zeros((1, 0, h * attn.v_head_dim))), topk_NK
    if ctx.attention is not None and ctx.attention.name != "torch":
        out = _absorbed_attention(attn, ctx.attention, q_pass, q_rot, views["kv"], topk_NK, absorbed, ctx=ctx,
                                  rope=rope)  # fmt: skip
        return attn.o_proj(out.to(hidden_states.dtype).view(1, n, h * attn.v_head_dim)), topk_NK
    if rope is not None:
        raise ValueError("rope must be None on the torch backend (projections rotate the query there)")
    query_HNC = torch.cat((q_pass, q_rot), dim=-1)
    latent_VC = read_rows(views["kv"], ctx.layouts["kv"], hidden_states.dtype)
    sel = latent_VC[topk_NK.clamp(min=0)].reshape(1, 1, n * k, r + e)  # [1, 1, N*k, R + E]
    # the class's expand_kv (kv_b_proj), never an instance wrap such as the reference's key rounding
    key, value = type(attn).expand_kv(attn, sel[..., :r], sel[..., r:])  # [1, H, N*k, nope+E], [1, H, N*k, v]
    key = key.view(h, n, k, attn.qk_head_dim)
    value = value.view(h, n, k, attn.v_head_dim)
    # float32 inside, one rounding at the end: what SDPA kernels do for half-precision inputs
    logits_HNK = torch.matmul(query_HNC.float()[..., None, :], key.float().transpose(-1, -2))[..., 0, :] * attn.scaling
    logits_HNK = logits_HNK.masked_fill((topk_NK < 0)[None], float("-inf"))
    probs = torch.softmax(logits_HNK, dim=-1)
    out_HNV = torch.matmul(probs[..., None, :], value.float())[..., 0, :]
    out = out_HNV.transpose(0, 1).to(hidden_states.dtype)
    return attn.o_proj(out.reshape(1, n, h * attn.v_head_dim)), topk_NK


def _absorbed_attention(
    attn, backend, q_pass, q_rot, kv_view, topk_NK, absorbed=None, ctx=None, rope=None
) -> torch.Tensor:
    """MLA in the absorbed form through a :mod:`dtkv.attention` kernel: ``[N, H, v_head_dim]``, contiguous.

    The latent query is ``q_nope @ W_UK`` (``[N, H, R]``, then the rope query: ``[N, H, R + E]``), the kernel attends
    over the stored latent rows (keys: latent and rope; values: the latent), and ``W_UV`` maps its latent output to
    the value heads: the same attention as the expanded form, other roundings. The products run in the dtype the
    backend takes queries in, or the weight's where wider (:class:`AbsorbedWeights`; Triton: float32; FlashMLA: bf16
    for a bf16 model, as its kernel, float32 for a float32 one). Both products write their results in place: the
    latent query into the kernel's ``[N, H, R + E]`` query beside the rope part, the value heads as ``[N, H, v]``
    (no concatenation, no transposed copy for ``o_proj``). A decode step (``ctx.decoding``: one query per
    request) takes the backend's decode kernel with the step's schedule (FlashMLA: ``N`` sequences of one query and
    tile-scheduler metadata built once per shape, capturable); other steps its prefill kernel.

    Args:
        q_pass: ``[H, N, nope]`` (any strides with a contiguous last dim: a view of ``q_b_proj``'s output).
        q_rot: ``[H, N, E]`` the rotated rope query, or the unrotated one with ``rope``.
        rope: ``None``, or ``(cos, sin)`` ``[N, E]``: ``q_rot`` is rotated as it is written into the query buffer
            (:func:`dtkv.ops.rope_interleave_into`, the model's interleaved MLA rope, its bits).
    """
    h, n, nope = q_pass.shape
    r, e = attn.kv_lora_rank, q_rot.shape[-1]
    dtype = _backend_dtype(backend, attn, absorbed)
    w_uk, w_uv_t = _factors(attn, absorbed, dtype)
    q = torch.empty((n, h, r + e), dtype=dtype, device=q_pass.device)
    torch.bmm(q_pass.to(dtype), w_uk, out=q[..., :r].transpose(0, 1))  # [H, N, nope] @ [H, nope, R]
    if rope is None:
        q[..., r:].copy_(q_rot.transpose(0, 1))
    else:
        ops.rope_interleave_into(q[..., r:], q_rot, *rope)
    idx = backend.indices(topk_NK, kv_view)
    if ctx is not None and ctx.decoding:
        schedule = ctx.decode_schedule(idx.shape[0], idx.shape[1])
        o_lat, _ = backend.decode(backend.cast_queries(q), kv_view, idx, softmax_scale=attn.scaling, schedule=schedule)
    else:
        o_lat, _ = backend.prefill(backend.cast_queries(q), kv_view, idx, softmax_scale=attn.scaling)
    out = torch.empty((n, h, w_uv_t.shape[-1]), dtype=dtype, device=q_pass.device)
    torch.bmm(o_lat.to(dtype).transpose(0, 1), w_uv_t, out=out.transpose(0, 1))  # [H, N, R] @ [H, R, v]
    return out


def _decode_attention(attn, ctx, hidden_states, q_pass, q_rot, index, prev_topk, absorbed=None):
    """Sharded decode: absorbed queries, the runtime's attention on the shards, then ``W_UV`` and ``o_proj``.

    The products run in float32 (the decode step's compute dtype), or in bf16 where the layer runs the production
    step's fused kernels (its own fp8 indexer) and the extend steps' products would be bf16
    (:func:`_absorbed_attention`: FlashMLA with a bf16 model): half the weight bytes, and the rounding FlashMLA
    takes the queries in anyway."""
    layer, n = attn.layer_idx, hidden_states.shape[1]
    h, v = attn.num_heads, attn.v_head_dim
    indexer = attn.indexer
    if indexer is not None:
        iq, ik, w_NI = index
        ctx.write("index", layer, ik)
        fp8 = uses_fp8_indexer(ctx.attention.name if ctx.attention is not None else "torch", ctx.layouts["index"])
        # the extend steps' indexer math, whatever kernel: fp8 queries are rounded where the step scores them (in
        # the fp8 indexer kernel on a GPU: DecodeQueries.iq_unrounded), as the full-view bucket's indexer does
        iq = iq if fp8 else iq.float()
        iw, positions = w_NI * indexer.softmax_scale, None  # relu(s * x) = s * relu(x), s > 0
    else:  # GLM: reuse the previous layer's selection (the indexer queries are not read)
        fp8 = False
        if prev_topk is None:
            raise ValueError(f"layer {layer} shares the previous layer's top-k, but got prev_topk_indices=None")
        iq = torch.zeros((n, 1, 1), dtype=torch.float32, device=hidden_states.device)
        iw, positions = iq[:, :, 0], prev_topk
    narrow = fp8 and ctx.attention is not None and _backend_dtype(ctx.attention, attn, absorbed) == torch.bfloat16
    dtype = torch.bfloat16 if narrow else torch.float32
    w_uk, w_uv_t = _factors(attn, absorbed, dtype)
    # one [N, H, R + E] buffer: the latent query written in place beside the rope part (the step reads it whole)
    r = w_uk.shape[-1]
    q = torch.empty((n, h, r + q_rot.shape[-1]), dtype=dtype, device=q_pass.device)
    torch.bmm(q_pass[0].to(dtype), w_uk, out=q[..., :r].transpose(0, 1))  # [H, N, nope] @ [H, nope, R]
    q[..., r:].copy_(q_rot[0].transpose(0, 1))
    queries = DecodeQueries(iq=iq, iw=iw, q_nope=q[..., :r], q_rope=q[..., r:], iq_fp8=fp8, iq_unrounded=fp8)
    # only a model whose layers share selections (GLM-5) reads the positions: the others skip their sort
    reuse = _SHARES.get(type(attn), True)
    res = ctx.decode_attention(layer, queries, softmax_scale=attn.scaling, positions=positions, return_positions=reuse)
    out_HNV = torch.matmul(res.out.transpose(0, 1), w_uv_t)  # [H, N, R] @ [H, R, v]
    out = out_HNV.transpose(0, 1).to(hidden_states.dtype).reshape(1, n, h * v)
    return attn.o_proj(out), res.positions


def dsa_attention(
    attn,
    ctx: StepContext,
    hidden_states: torch.Tensor,
    position_embeddings,
    prev_topk=None,
    absorbed: AbsorbedWeights | None = None,
    project=None,
):
    """One DSA layer's attention for this rank's rows (run phase: tensors only).

    Args:
        attn: the model's attention module (``DeepseekV32Attention`` / ``GlmMoeDsaAttention``).
        ctx: the step's :class:`dtkv.runtime.StepContext`.
        hidden_states: ``[1, N, D]`` normalized hidden states of the rows (model dtype).
        position_embeddings: ``(cos, sin)`` ``[1, N, E]`` of the rows' positions (the model's rotary embedding).
        prev_topk: the previous layer's selection, for GLM layers without an indexer: view slots ``[N, k]`` in an
            extend step, positions ``[N, K]`` in a sharded decode step.
        absorbed: the module's :class:`AbsorbedWeights` (what :func:`install` binds); ``None`` takes the halves of
            ``kv_b_proj`` on every call.
        project: what computes :func:`projections` (``None``: that function, eager; the adapter passes its compiled
            form, :func:`dtkv.integrations.transformers._compile.compiled_function`).

    Returns:
        ``(out [1, N, D], topk [N, k])``: the layer's output and its selection (as ``prev_topk`` takes it).
    """
    mla_rope, indexer_rope = _ropes(attn)
    cos, sin = position_embeddings
    # decode steps (a few rows: the GEMMs read their weights) run the input projections as one GEMM
    fused = absorbed.input_weight() if absorbed is not None and ctx.decoding else None
    # extend steps on an absorbed backend rotate the query where they write it into the kernel's query buffer
    late = not ctx.decoding and not ctx.sharded_decode and fuses_query_rope(ctx, hidden_states, cos, mla_rope)
    kwargs = {"rope_query": False} if late else {}
    q_pass, q_rot, latent, index = (project or projections)(attn, hidden_states, cos, sin, mla_rope, indexer_rope,
                                                            fused, **kwargs)  # fmt: skip
    ctx.write("kv", attn.layer_idx, latent)  # the latent row [N, R + E]
    if ctx.sharded_decode:
        return _decode_attention(attn, ctx, hidden_states, q_pass, q_rot, index, prev_topk, absorbed)
    rope = (cos[0], sin[0]) if late else None
    return _extend_attention(attn, ctx, hidden_states, q_pass[0], q_rot[0], index, prev_topk, absorbed, rope)


def fuses_query_rope(ctx: StepContext, hidden_states: torch.Tensor, cos: torch.Tensor, mla_rope) -> bool:
    """Whether an extend step writes the MLA query's rope straight into the absorbed kernel's query buffer
    (:func:`dtkv.ops.rope_interleave_into`) instead of rotating it in :func:`projections` and copying it: an
    absorbed backend (not ``torch``), the family's MLA rope the interleaved one the op computes, bf16 or float32
    rows with angles of their dtype."""
    return (
        ctx.attention is not None
        and ctx.attention.name != "torch"
        and getattr(mla_rope, "__name__", "") == "apply_rotary_pos_emb_interleave"
        and hidden_states.dtype in ROPE_DTYPES
        and cos.dtype == hidden_states.dtype
    )


def check_unbound(model: torch.nn.Module) -> None:
    """Raise ``ValueError`` if ``model``'s attention modules already have a bound forward (one runtime at a time)."""
    if any("forward" in vars(layer.self_attn) for layer in model.model.layers):
        raise ValueError(
            "model's attention modules already have a bound forward (another runtime wraps this model); "
            "close() that runtime first"
        )


def install(model: torch.nn.Module, adapter, *, project=None) -> None:
    """Bind :func:`dsa_attention` as ``forward`` of every attention module of ``model`` (instance attribute).

    The bound forward reads ``adapter.ctx`` (the step's :class:`dtkv.runtime.StepContext`); while it is None the
    module runs its original forward, so the model stays usable on its own. Each bound forward holds the module's
    :class:`AbsorbedWeights` (``kv_b_proj``'s halves, taken once per dtype for the whole bind) and ``project``
    (:func:`dsa_attention`'s argument: ``None`` runs :func:`projections` eager).

    Raises:
        ValueError: the modules already have a bound forward (one runtime per model at a time).
    """
    returns_topk = adapter.family.returns_topk
    check_unbound(model)
    for layer in model.model.layers:
        attn = layer.self_attn
        _ropes(attn)
        original = type(attn).forward.__get__(attn)
        absorbed = AbsorbedWeights(attn)

        def forward(*args, _attn=attn, _original=original, _absorbed=absorbed, **kwargs):
            ctx = adapter.ctx
            if ctx is None:
                return _original(*args, **kwargs)
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            rope = kwargs["position_embeddings"] if "position_embeddings" in kwargs else args[1]
            out, topk = dsa_attention(_attn, ctx, hidden, rope, kwargs.get("prev_topk_indices"), _absorbed, project)
            return (out, None, topk) if returns_topk else (out, None)

        attn.forward = forward


def uninstall(model: torch.nn.Module) -> None:
    """Remove the bound forwards (the class forward applies again)."""
    for layer in model.model.layers:
        layer.self_attn.__dict__.pop("forward", None)
