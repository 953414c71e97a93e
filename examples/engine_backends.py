"""Where each dtkv call goes in a serving engine's attention backend: skeletons of sglang's ``AttentionBackend`` and
of vLLM's ``AttentionMetadataBuilder`` (``docs/engines.md`` explains them). Neither engine is imported: in an engine,
write ``class DtkvBackend(AttentionBackend)`` / ``class DtkvBuilder(AttentionMetadataBuilder[...])`` with these
bodies. The hook names and signatures were read from (the engines' files, pinned to the commits read):

- sglang ``python/sglang/srt/layers/attention/base_attn_backend.py`` @ 43681aaa768047065d50fb746c884077a44ed505,
  ``python/sglang/srt/model_executor/forward_batch_info.py`` (``ForwardBatch``)
  @ 271a25bc88ee9d9ada9b117299f2b9849e597569;
- vLLM ``vllm/v1/attention/backend.py`` (``AttentionBackend``, ``AttentionMetadataBuilder``,
  ``CommonAttentionMetadata``) @ e379cf37ec69dd7a07c87fe74413abb9193e9500, and its DeepSeek-V3.2 builder
  ``vllm/v1/attention/backends/mla/flashmla_sparse.py`` @ 60191e18faee97b8d70c19b14f934bdf73a6ac6b.

``python examples/engine_backends.py`` drives both skeletons through one extend batch in one process, with stand-ins
for the engines' batch objects, and checks that the kernel sees every row the layer wrote.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import torch

from dtkv import IndexerFp8Layout, MLAFp8Layout, PageOwnership, ShardedKVPool, ops
from dtkv.materialize import Materializer, plan_materialize


class CPViews:
    """What either skeleton holds: the CP group's sharded pool and ONE Materializer, built at start-up.

    The start-up plan is the empty batch; ``max_view_pages`` is the view of the largest batch the engine schedules
    (its token budget in pages, padded per owner), so serving allocates nothing. Per batch, :meth:`plan` (host, not
    captured) replans it only when the batch's page lists changed (a decode batch keeps them for up to a page of
    steps), and on CUDA captures the gathers as graphs for that plan.
    """

    def __init__(self, pool: ShardedKVPool, *, max_view_pages: int, history_group=None) -> None:
        self.pool, self.page_size = pool, pool.page_size
        empty = plan_materialize([], [], pool.ownership, pool.rank, device=pool.device, group=pool.group)
        self.mat = Materializer(pool, empty, max_view_pages=max_view_pages, history_group=history_group)

    def plan(self, req_pages: list[torch.Tensor], prefix_lens: list[int], seq_lens: list[int]) -> None:
        ps = self.page_size
        hist = [int(p) for pages, n in zip(req_pages, prefix_lens) for p in pages[: n // ps]]
        cur = [int(p) for pages, n, s in zip(req_pages, prefix_lens, seq_lens) for p in pages[n // ps : -(-s // ps)]]
        plan = plan_materialize(hist, cur, self.pool.ownership, self.pool.rank, device=self.pool.device,
                                group=self.pool.group)  # fmt: skip  # collective: every rank, same batch
        if plan.digest != self.mat.plan.digest:
            self.mat.replan(plan)  # views from before belong to the new plan now: read none of them
            if self.pool.device.type == "cuda":
                self.mat.capture()  # graphs of this plan's gathers; later prefetch()/view() replay them

    def write(self, layer: int, kv: torch.Tensor, index_k: torch.Tensor, locs: torch.Tensor) -> None:
        """This rank's rows into its own pages (run phase): ``locs`` are the slots of the tokens it computed."""
        p = self.pool
        ops.quantize_write_mla_fp8(p.local("kv", layer), kv, locs, p.ownership, p.rank, layout=p.layouts["kv"],
                                   direct=True)  # fmt: skip
        ops.quantize_write_indexer_fp8(p.local("index", layer), index_k, locs, p.ownership, p.rank,
                                       layout=p.layouts["index"], direct=True)  # fmt: skip

    def view(self, layer: int) -> dict[str, torch.Tensor]:
        """``layer``'s full view, after its writes; valid until ``prefetch(layer + 2)`` or the next replan."""
        self.mat.prefetch(layer + 1)  # the next layer's history pages gather while this layer attends
        return self.mat.view(layer)

    def slots(self, locs: torch.Tensor) -> torch.Tensor:
        """Logical token slots (a page table's, or the indexer's top-k) -> rows of the view (``-1`` kept)."""
        return ops.remap(locs, self.mat.plan.page_map, page_size=self.page_size)


class SglangBackend:
    """``class DtkvBackend(AttentionBackend)``: sglang calls these hooks; the kernel is the engine's, unmodified."""

    def __init__(self, views: CPViews, kernel) -> None:
        self.views, self.kernel = views, kernel  # kernel(q, view, slots): e.g. FlashMLA's sparse prefill
        self.key_slots: torch.Tensor | None = None

    def init_forward_metadata(self, forward_batch) -> None:
        """Once per batch, before layer 0 (plan phase): the view's plan, then every key slot in view rows."""
        fb, ps = forward_batch, self.views.page_size
        r2t = fb.req_to_token_pool.req_to_token  # int32 [max_reqs, max_context_len] token slots
        seq = [int(n) for n in fb.seq_lens_cpu]
        prefix = list(fb.extend_prefix_lens_cpu) if not fb.forward_mode.is_decode() else [n - 1 for n in seq]
        rows = [r2t[int(i), :n] for i, n in zip(fb.req_pool_indices, seq)]
        self.views.plan([r[::ps].long() // ps for r in rows], prefix, seq)
        self.key_slots = self.views.slots(torch.cat(rows).long())

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        """One layer (run phase). ``k``: this rank's new latent rows; ``v`` carries the indexer keys here."""
        if save_kv_cache:  # where sglang calls token_to_kv_pool.set_mla_kv_buffer(layer, out_cache_loc, ...)
            self.views.write(layer.layer_id, k, v, forward_batch.out_cache_loc)
        return self.kernel(q, self.views.view(layer.layer_id), self.key_slots)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        """The same view (or ``dtkv.decode.DecodeStep.layer``: sharded decode, no view; see the graph hooks)."""
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache)

    # CUDA graphs of decode: the view's plan would be frozen inside sglang's graph, so decode there runs
    # dtkv.decode.DecodeStep (one per batch-size bucket; its plan is a device buffer that set_plan refills).
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.decode_steps: dict[int, object] = {}  # bucket -> DecodeStep(pool, DecodeStepConfig(max_batch=bs, ...))

    def init_forward_metadata_capture_cuda_graph(self, bs, num_tokens, req_pool_indices, seq_lens, encoder_lens,
                                                 forward_mode, spec_info):  # fmt: skip
        """Build the bucket's ``DecodeStep`` and give it a plan (``set_plan``) before sglang records the graph."""

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, seq_lens_sum, encoder_lens,
                                                forward_mode, spec_info, seq_lens_cpu):  # fmt: skip
        """Per step: ``decode_steps[bs].set_plan(page_tables, seq_lens_cpu)`` (host copy, no recapture)."""

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1  # padded rows decode one token of a dummy request


class VllmBuilder:
    """``class DtkvBuilder(AttentionMetadataBuilder[DtkvMetadata])`` of a backend whose ``get_builder_cls()``
    returns it; vLLM's model runner calls ``build`` once per step, before the layers."""

    _cudagraph_support = "AttentionCGSupport.UNIFORM_BATCH"  # as the sparse FlashMLA builder declares (decode)

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device, *, views: CPViews | None = None) -> None:
        self.kv_cache_spec, self.layer_names = kv_cache_spec, layer_names
        self.vllm_config, self.device = vllm_config, device
        self.views = views  # built at start-up beside the KV cache (vLLM's block ids are dtkv's logical pages)

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        """Plan phase: block table + seq lens -> the view's plan; the metadata the impl's ``forward`` reads."""
        m, ps = common_attn_metadata, self.views.page_size
        seq = m.seq_lens.cpu().tolist()
        q_lens = (m.query_start_loc_cpu[1:] - m.query_start_loc_cpu[:-1]).tolist()
        pages = [m.block_table_tensor[i, : -(-n // ps)].long().cpu() for i, n in enumerate(seq)]
        self.views.plan(pages, [n - q for n, q in zip(seq, q_lens)], seq)
        locs = torch.cat([(p[:, None] * ps + torch.arange(ps)).reshape(-1)[:n] for p, n in zip(pages, seq)])
        return SimpleNamespace(slot_mapping=m.slot_mapping, key_slots=self.views.slots(locs.to(self.device)))

    def build_for_cudagraph_capture(self, common_attn_metadata):
        return self.build(0, common_attn_metadata)  # decode graphs: as sglang's, through dtkv.decode.DecodeStep

    # The impl (``get_impl_cls()``): ``forward(layer, query, key, value, kv_cache, attn_metadata, output=...)`` --
    # MLA's ``(layer, hidden_states_or_cq, kv_c_normed, k_pe, kv_cache, attn_metadata, output=...)`` -- writes
    # with CPViews.write at ``attn_metadata.slot_mapping`` and runs its kernel on CPViews.view(layer_idx).


def _smoke() -> int:
    """One extend batch of two requests through both skeletons, one process (a CP group of one)."""
    ps, layers = 4, 2
    lay = {"kv": MLAFp8Layout(page_size=ps, kv_lora_rank=64, rope_dim=16, quant_block=32),
           "index": IndexerFp8Layout(page_size=ps, head_dim=32)}  # fmt: skip
    pool = ShardedKVPool(lay, PageOwnership(1, 32), num_layers=layers)
    views = CPViews(pool, max_view_pages=32)
    r2t = torch.full((4, 64), -1, dtype=torch.int32)
    seq = [9, 5]
    for i, (n, first) in enumerate(zip(seq, (3, 10))):  # the engine's allocator gave pages 3.. and 10..
        r2t[i, :n] = torch.arange(first * ps, first * ps + n, dtype=torch.int32)
    locs = torch.cat([r2t[i, :n] for i, n in enumerate(seq)]).long()
    mode = SimpleNamespace(is_decode=lambda: False)
    fb = SimpleNamespace(forward_mode=mode, req_pool_indices=torch.tensor([0, 1]), seq_lens_cpu=torch.tensor(seq),
                         extend_prefix_lens_cpu=[0, 0], out_cache_loc=locs,
                         req_to_token_pool=SimpleNamespace(req_to_token=r2t))  # fmt: skip
    backend = SglangBackend(views, kernel=lambda q, view, slots: view["kv"].reshape(-1, lay["kv"].row_bytes)[slots])
    backend.init_forward_metadata(fb)
    ok = True
    for layer in range(layers):
        kv, ik = torch.randn(len(locs), 80), torch.randn(len(locs), 32)
        seen = backend.forward_extend(None, kv, ik, SimpleNamespace(layer_id=layer), fb)
        ok &= torch.equal(seen, ops.quantize_mla_fp8(kv, lay["kv"]))  # every key row as the layer wrote it
    qsl = torch.tensor([0, 9, 14])
    meta = SimpleNamespace(seq_lens=torch.tensor(seq), query_start_loc_cpu=qsl, slot_mapping=locs,
                           block_table_tensor=torch.tensor([[3, 4, 5], [10, 11, -1]]))  # fmt: skip
    built = VllmBuilder(None, ["layers.0"], None, pool.device, views=views).build(0, meta)
    ok &= torch.equal(built.key_slots, backend.key_slots)  # the two engines' maps give the same view rows
    print(f"sglang backend and vLLM builder skeletons: {layers} layers, view rows equal to the written rows: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(_smoke())
