"""Byte-exact CPU oracle of the transfer descriptors (no engine).

Each case fills the prefill ranks' shards from one seeded global pool, fills decode with garbage, applies the
plan with a bounds-checked ``memmove`` simulator on the real tensor addresses (packs and unpacks included)
and compares decode's reassembled pool with the reference: position ``i``'s page goes from
``src_pages[i]`` to ``dst_pages[i]`` in every layer and buffer, and every other decode byte is untouched.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from dtkv import IndexerFp8Layout, MLAFp8Layout, MLALatentLayout, PageOwnership
from dtkv.transfer import KVShard, PlanOptions, plan_request
from dtkv.transfer.coalesce import coalesce_entries, page_runs, split_batches

NUM_LAYERS = 3
PAGE_SIZE = 4
P_PREFILL = 37  # pages of the prefill pool (not a multiple of any cp)
P_DECODE = 29


def _layouts(latent: bool = False):
    mla = (
        MLALatentLayout(page_size=PAGE_SIZE, kv_lora_rank=16, rope_dim=8)
        if latent
        else MLAFp8Layout(page_size=PAGE_SIZE, kv_lora_rank=32, rope_dim=8, quant_block=16)
    )
    return {"kv": mla, "index": IndexerFp8Layout(page_size=PAGE_SIZE, head_dim=16)}


def _global_bytes(layouts, num_pages, seed, num_layers=NUM_LAYERS):
    g = torch.Generator().manual_seed(seed)
    return {
        n: torch.randint(0, 256, (num_layers, num_pages, lay.page_bytes), generator=g, dtype=torch.uint8)
        for n, lay in layouts.items()
    }


def _shards(layouts, ownership, full, num_layers=NUM_LAYERS, **kw):
    shards = []
    for r in range(ownership.cp_size):
        s = KVShard.allocate(layouts, ownership, r, num_layers=num_layers, **kw)
        idx = ownership.local_pages(r)
        for n, buf in s.buffers.items():
            buf.view(torch.uint8).view(num_layers, idx.numel(), -1).copy_(full[n][:, idx])
        shards.append(s)
    return shards


def _reassemble(shards, ownership):
    out = {}
    for s in shards:
        idx = ownership.local_pages(s.rank)
        for n, buf in s.buffers.items():
            t = out.setdefault(
                n, torch.empty(s.num_layers, ownership.num_pages, s.layouts[n].page_bytes, dtype=torch.uint8)
            )
            t[:, idx] = buf.view(torch.uint8).view(s.num_layers, idx.numel(), -1)
    return out


def _regions(shard):
    return [(t.data_ptr(), t.numel() * t.element_size()) for t in shard.registered_tensors()]


def _inside(addr, length, regions):
    return any(a <= addr and addr + length <= a + n for a, n in regions)


def apply_plan(plan, pre, dec):
    """The memcpy simulator, one layer group at a time: pack the group, copy its entries (bounds-checked, no
    destination byte written twice over the request), unpack it. An entry filed under the wrong group would
    reach decode after its group was unpacked, and the comparison would fail."""
    written = []
    for c in range(plan.num_layer_groups):
        layers = slice(int(plan.layer_bounds[c]), int(plan.layer_bounds[c + 1]))
        for sp in plan.senders:
            pre[sp.rank].pack(sp.pack, layers)
            for peer in sp.peers:
                src_regions, dst_regions = _regions(pre[sp.rank]), _regions(dec[peer.decode_rank])
                sl = peer.group(c)
                for a, b, n in zip(peer.src[sl].tolist(), peer.dst[sl].tolist(), peer.length[sl].tolist()):
                    assert n > 0 and _inside(a, n, src_regions), f"source entry {a}+{n} outside prefill {sp.rank}"
                    assert _inside(b, n, dst_regions), f"destination entry {b}+{n} outside decode {peer.decode_rank}"
                    ctypes.memmove(b, a, n)
                    written.append((b, n))
        for s in dec:
            s.unpack(plan.unpack_for(s.rank), layers)
    written.sort()
    for (a, n), (b, _) in zip(written, written[1:]):
        assert a + n <= b, "a destination byte is written twice"


def _request(num_tokens, seed):
    rng = np.random.default_rng(seed)
    n = -(-num_tokens // PAGE_SIZE)
    src = rng.permutation(P_PREFILL)[:n]
    src[: n // 2] = np.sort(src[: n // 2])  # a sorted prefix: some runs to coalesce
    dst = rng.permutation(P_DECODE)[:n]
    dst[n // 3 :] = np.sort(dst[n // 3 :])
    return src, dst


def run_oracle(
    cp_p,
    layout_p,
    decode,
    num_tokens,
    staging,
    *,
    latent=False,
    seed=0,
    staging_bytes=1 << 20,
    layouts=None,
    chunks=1,
    page_major=(False, False),
    num_layers=NUM_LAYERS,
):
    """``page_major``: (prefill, decode) pool layouts."""
    layouts = layouts or _layouts(latent)
    own_p = PageOwnership(cp_p, P_PREFILL, layout_p)
    own_d = PageOwnership(decode[0], P_DECODE, decode[1])
    pre_full = _global_bytes(layouts, P_PREFILL, seed, num_layers)
    dec_full = _global_bytes(layouts, P_DECODE, seed + 1, num_layers)  # garbage that untouched pages must keep
    pre = _shards(layouts, own_p, pre_full, num_layers, staging_bytes=staging_bytes, page_major=page_major[0])
    dec = _shards(layouts, own_d, dec_full, num_layers, staging_bytes=staging_bytes, page_major=page_major[1])
    assert [s.page_major for s in pre + dec] == [page_major[0]] * len(pre) + [page_major[1]] * len(dec)
    src, dst = _request(num_tokens, seed)
    plan = plan_request(
        src,
        dst,
        prefill=[s.endpoint("prefill", "p") for s in pre],
        decode=[s.endpoint("decode", "d") for s in dec],
        options=PlanOptions(staging=staging, layer_groups=chunks),
    )
    apply_plan(plan, pre, dec)
    got = _reassemble(dec, own_d)
    for n in layouts:
        want = dec_full[n].clone()
        want[:, torch.from_numpy(dst)] = pre_full[n][:, torch.from_numpy(src)]
        assert torch.equal(got[n], want), f"buffer {n!r} differs"
        assert torch.equal(_reassemble(pre, own_p)[n], pre_full[n]), f"prefill buffer {n!r} was modified"
    positions = np.concatenate([sp.positions for sp in plan.senders])
    assert np.array_equal(np.sort(positions), np.arange(src.shape[0])), "every position must be sent exactly once"
    return plan


DECODES = [(1, "interleave"), (2, "interleave"), (2, "block"), (3, "interleave"), (4, "block")]


class TestOracle:
    """Decode's reassembled KV equals the reference byte for byte, for every prefill cp x decode layout."""

    @pytest.mark.parametrize("staging", ["auto", "off", "full"])
    @pytest.mark.parametrize("decode", DECODES, ids=[f"d{c}{lay[0]}" for c, lay in DECODES])
    @pytest.mark.parametrize("layout_p", ["interleave", "block"])
    @pytest.mark.parametrize("cp_p", [1, 2, 4])
    def test_cross_product_vs_reference(self, cp_p, layout_p, decode, staging):
        run_oracle(cp_p, layout_p, decode, num_tokens=23 * PAGE_SIZE - 1, staging=staging, seed=cp_p)

    @pytest.mark.parametrize("num_tokens", [0, 1, PAGE_SIZE, PAGE_SIZE + 1, 5 * PAGE_SIZE - 3, P_DECODE * PAGE_SIZE])
    @pytest.mark.parametrize("cp_p", [1, 2, 4])
    def test_request_sizes_partial_last_page_and_empty(self, cp_p, num_tokens):
        plan = run_oracle(cp_p, "interleave", (2, "block"), num_tokens, "auto", seed=num_tokens)
        assert plan.num_positions == -(-num_tokens // PAGE_SIZE)
        if num_tokens == 0:
            assert plan.num_entries == 0 and plan.min_entries == 0

    @pytest.mark.parametrize("chunks", [2, 3, 5])
    @pytest.mark.parametrize("staging", ["auto", "full"])
    @pytest.mark.parametrize("decode", [(1, "interleave"), (3, "block")], ids=["d1", "d3b"])
    @pytest.mark.parametrize("cp_p", [2, 4])
    def test_layer_groups_vs_reference(self, cp_p, decode, staging, chunks):
        """Pipelined plans: each layer group's entries, packs and unpacks stand alone."""
        plan = run_oracle(cp_p, "interleave", decode, 19 * PAGE_SIZE - 2, staging, chunks=chunks)
        assert plan.num_layer_groups == min(chunks, NUM_LAYERS)
        for sp in plan.senders:
            for peer in sp.peers:
                assert peer.group_indptr[-1] == peer.num_entries and np.all(np.diff(peer.group_indptr) > 0)

    def test_latent_bf16_layout(self):
        run_oracle(2, "interleave", (1, "interleave"), 41, "full", latent=True)

    @pytest.mark.parametrize("staging", ["full", "off"])
    def test_odd_page_bytes(self, staging):
        """10- and 5-byte pages (page_size 1): staging regions fall back to element alignment and byte copies."""
        odd = {
            "kv": MLAFp8Layout(page_size=1, kv_lora_rank=4, rope_dim=1, quant_block=4),
            "index": IndexerFp8Layout(page_size=1, head_dim=1),
        }
        run_oracle(4, "interleave", (3, "block"), 21, staging, layouts=odd)

    def test_small_staging_falls_back_to_direct(self):
        plan = run_oracle(4, "interleave", (1, "interleave"), 80, "full", staging_bytes=2048)
        assert plan.staged_bytes < plan.num_bytes


SIDES = [(True, True), (True, False), (False, True)]
SIDE_IDS = ["pm-pm", "pm-lm", "lm-pm"]


class TestPageMajorOracle:
    """Page-major pools on either side or both: decode's bytes equal the reference, whatever the plan's shape."""

    @pytest.mark.parametrize("staging", ["auto", "off", "full"])
    @pytest.mark.parametrize("decode", DECODES, ids=[f"d{c}{lay[0]}" for c, lay in DECODES])
    @pytest.mark.parametrize("cp_p", [1, 3])
    @pytest.mark.parametrize("sides", SIDES, ids=SIDE_IDS)
    def test_cross_product_vs_reference(self, sides, cp_p, decode, staging):
        run_oracle(cp_p, "block", decode, 23 * PAGE_SIZE - 1, staging, seed=cp_p, page_major=sides)

    @pytest.mark.parametrize("chunks", [1, 2, 3])
    @pytest.mark.parametrize("staging", ["auto", "full", "off"])
    @pytest.mark.parametrize("sides", SIDES, ids=SIDE_IDS)
    def test_layer_groups_vs_reference(self, sides, staging, chunks):
        plan = run_oracle(2, "interleave", (3, "block"), 19 * PAGE_SIZE - 2, staging, chunks=chunks, page_major=sides)
        for sp in plan.senders:
            for peer in sp.peers:
                assert peer.group_indptr[-1] == peer.num_entries

    @pytest.mark.parametrize("num_layers", [1, 2, 5])
    @pytest.mark.parametrize("num_tokens", [0, 1, PAGE_SIZE + 1, P_DECODE * PAGE_SIZE])
    @pytest.mark.parametrize("sides", SIDES, ids=SIDE_IDS)
    def test_awkward_sizes(self, sides, num_tokens, num_layers):
        """One layer (both layouts the same bytes), an empty request, the whole decode pool; decode cp 4 of 29
        pages in blocks of 8: its last rank holds 5 pages, prefill cp 5 of 37 interleaved."""
        run_oracle(5, "interleave", (4, "block"), num_tokens, "auto", page_major=sides, num_layers=num_layers)

    @pytest.mark.parametrize("staging", ["full", "off"])
    def test_odd_page_bytes(self, staging):
        odd = {
            "kv": MLAFp8Layout(page_size=1, kv_lora_rank=4, rope_dim=1, quant_block=4),
            "index": IndexerFp8Layout(page_size=1, head_dim=1),
        }
        for sides in SIDES:
            run_oracle(4, "interleave", (3, "block"), 21, staging, layouts=odd, page_major=sides)

    def test_latent_bf16_layout(self):
        for sides in SIDES:
            run_oracle(2, "interleave", (1, "interleave"), 41, "full", latent=True, page_major=sides)


class TestEntryCounts:
    """Coalescing reaches the minimum when placement allows it, and staging does when it does not."""

    def _endpoints(self, cp_p, cp_d, *, staging_bytes=0, layout_d="interleave", num_pages=64, page_major=(0, 0)):
        layouts = _layouts()
        own_p, own_d = PageOwnership(cp_p, num_pages), PageOwnership(cp_d, num_pages, layout_d)
        pm_p, pm_d = bool(page_major[0]), bool(page_major[1])
        kw = {"num_layers": NUM_LAYERS, "staging_bytes": staging_bytes}
        pre = [KVShard.allocate(layouts, own_p, r, page_major=pm_p, **kw) for r in range(cp_p)]
        dec = [KVShard.allocate(layouts, own_d, r, page_major=pm_d, **kw) for r in range(cp_d)]
        return [s.endpoint("prefill", "p") for s in pre], [s.endpoint("decode", "d") for s in dec]

    def test_page_major_sides_one_entry_per_run_and_buffer(self):
        """Both page-major: a run of pages contiguous on both sides is one entry for every layer."""
        pages = np.arange(8, 40)  # rank r sends its 16 pages to decode rank r, contiguous on both sides
        page_bytes = [lay.page_bytes for lay in _layouts().values()]
        pre, dec = self._endpoints(2, 2, page_major=(1, 1))
        for groups in (1, 3):  # nothing to stage: one entry per run whatever the layer groups
            opts = PlanOptions(staging="off", layer_groups=groups)
            plan = plan_request(pages, pages + 16, prefill=pre, decode=dec, options=opts)
            assert plan.num_entries == 2 * 2 and plan.min_entries == 2  # ranks x buffers
            lengths = sorted(int(n) for sp in plan.senders for p in sp.peers for n in p.length)
            assert lengths == sorted([16 * NUM_LAYERS * b for b in page_bytes] * 2)
        pre, dec = self._endpoints(1, 1, page_major=(1, 1))
        src, dst = [0, 1, 2, 5, 6, 9], [10, 11, 12, 3, 4, 20]  # runs 0-2 -> 10-12, 5-6 -> 3-4, 9 -> 20
        plan = plan_request(src, dst, prefill=pre, decode=dec, options=PlanOptions(staging="off"))
        assert plan.num_entries == 3 * 2
        pre, dec = self._endpoints(1, 1)
        plan = plan_request(src, dst, prefill=pre, decode=dec, options=PlanOptions(staging="off"))
        assert plan.num_entries == 3 * NUM_LAYERS * 2  # layer-major: one per run, layer and buffer

    @pytest.mark.parametrize("page_major", [(1, 0), (0, 1)], ids=["pm-lm", "lm-pm"])
    def test_mixed_sides_one_entry_per_page_and_layer_unless_staged(self, page_major):
        pages = np.arange(8, 40)
        pre, dec = self._endpoints(2, 2, page_major=page_major)
        plan = plan_request(pages, pages + 16, prefill=pre, decode=dec, options=PlanOptions(staging="off"))
        assert plan.num_entries == 32 * NUM_LAYERS * 2  # pages x layers x buffers
        pre, dec = self._endpoints(2, 2, page_major=page_major, staging_bytes=1 << 20)
        full = PlanOptions(staging="full", layer_groups=1)
        plan = plan_request(pages, pages + 16, prefill=pre, decode=dec, options=full)
        assert plan.num_entries == plan.min_entries == 2  # both sides staged: layer-major regions, one entry a pair

    def test_mixed_sides_of_one_layer_are_runs(self):
        """With one layer the two layouts are the same bytes: the merged entries are the runs."""
        layouts = _layouts()
        own = PageOwnership(1, 16)
        pre = [KVShard.allocate(layouts, own, 0, num_layers=1, page_major=True).endpoint("prefill", "p")]
        dec = [KVShard.allocate(layouts, own, 0, num_layers=1).endpoint("decode", "d")]
        plan = plan_request([0, 1, 2, 5, 6], [3, 4, 5, 9, 10], prefill=pre, decode=dec, options=PlanOptions())
        assert plan.num_entries == 2 * 2

    def test_same_placement_contiguous_pages_one_entry_per_layer_and_buffer(self):
        pre, dec = self._endpoints(2, 2)
        pages = np.arange(8, 40)
        plan = plan_request(pages, pages + 16, prefill=pre, decode=dec, options=PlanOptions(staging="off"))
        assert plan.num_entries == 2 * NUM_LAYERS * 2  # ranks x layers x buffers
        assert plan.min_entries == 2

    def test_nothing_staged_means_one_layer_group(self):
        pre, dec = self._endpoints(2, 1)
        plan = plan_request(np.arange(8), np.arange(8), prefill=pre, decode=dec, options=PlanOptions(layer_groups=3))
        assert plan.staged_bytes == 0 and plan.num_layer_groups == 1

    def test_whole_pool_merges_layers(self):
        pre, dec = self._endpoints(1, 1, num_pages=16)
        one_group = PlanOptions(staging="off", layer_groups=1)
        plan = plan_request(np.arange(16), np.arange(16), prefill=pre, decode=dec, options=one_group)
        assert plan.num_entries == 2 and plan.min_entries == 1  # one per buffer: the layers are contiguous too

    def test_cp_prefill_to_full_decode_is_strided_without_staging(self):
        pre, dec = self._endpoints(4, 1)
        pages = np.arange(32)
        plan = plan_request(pages, pages, prefill=pre, decode=dec, options=PlanOptions(staging="off"))
        assert plan.num_entries == 32 * NUM_LAYERS * 2  # every page alone, in every layer and buffer

    def test_full_staging_reaches_the_minimum(self):
        pre, dec = self._endpoints(4, 3, staging_bytes=1 << 20, layout_d="block")
        rng = np.random.default_rng(0)
        plan = plan_request(
            rng.permutation(64)[:40],
            rng.permutation(64)[:40],
            prefill=pre,
            decode=dec,
            options=PlanOptions(staging="full", layer_groups=1),
        )
        assert plan.num_entries == plan.min_entries == 12  # every (prefill, decode) pair once

    def test_auto_stages_only_when_it_pays(self):
        """Aligned placement: 6 entries per rank pair direct, 1 staged; staging pays only if copies are cheap."""
        pages = np.arange(32)
        pre, dec = self._endpoints(4, 1, staging_bytes=1 << 20)
        strided = plan_request(pages, pages, prefill=pre, decode=dec)
        assert strided.staged_bytes > 0 and strided.num_entries < 32 * NUM_LAYERS * 2
        pre, dec = self._endpoints(2, 2, staging_bytes=1 << 20)
        fast = PlanOptions(copy_bytes_per_s=1e10, layer_groups=1)
        cheap = plan_request(pages, pages, prefill=pre, decode=dec, options=fast)
        assert cheap.num_entries == cheap.min_entries == 2
        slow = plan_request(pages, pages, prefill=pre, decode=dec, options=PlanOptions(copy_bytes_per_s=1e8))
        assert slow.staged_bytes == 0 and slow.num_entries == 2 * NUM_LAYERS * 2


class TestMeta:
    """The replicated metadata row has exactly one sender and reaches every decode rank."""

    @pytest.mark.parametrize("meta_sender", [0, 3])
    def test_one_sender_every_decode_rank(self, meta_sender):
        layouts = _layouts()
        own_p, own_d = PageOwnership(4, P_PREFILL), PageOwnership(2, P_DECODE, "block")
        pre = [KVShard.allocate(layouts, own_p, r, num_layers=1, meta_num_rows=4, meta_row_bytes=16) for r in range(4)]
        dec = [KVShard.allocate(layouts, own_d, r, num_layers=1, meta_num_rows=8, meta_row_bytes=16) for r in range(2)]
        pre[meta_sender].meta[2] = torch.arange(16, dtype=torch.uint8)
        plan = plan_request(
            [1, 2, 3],
            [4, 5, 6],
            prefill=[s.endpoint("prefill", "p") for s in pre],
            decode=[s.endpoint("decode", "d") for s in dec],
            options=PlanOptions(meta_sender=meta_sender),
            src_meta_slot=2,
            dst_meta_slot=7,
        )
        senders = [sp.rank for sp in plan.senders for p in sp.peers if p.meta]
        assert senders == [meta_sender, meta_sender]
        apply_plan(plan, pre, dec)
        for s in dec:
            assert s.meta[7].tolist() == list(range(16)) and int(s.meta[:7].sum()) == 0


class TestRejects:
    def _eps(self, **kw):
        layouts = _layouts()
        pre = [KVShard.allocate(layouts, PageOwnership(1, 8), 0, num_layers=2)]
        dec = [
            KVShard.allocate(kw.get("dec_layouts", layouts), PageOwnership(1, 8), 0, num_layers=kw.get("dec_layers", 2))
        ]
        return [s.endpoint("prefill", "p") for s in pre], [s.endpoint("decode", "d") for s in dec]

    def test_rejects_length_mismatch(self):
        pre, dec = self._eps()
        with pytest.raises(ValueError, match=r"src_pages and dst_pages must have equal lengths, got 2 and 1"):
            plan_request([0, 1], [0], prefill=pre, decode=dec)

    def test_rejects_out_of_range_and_repeats(self):
        pre, dec = self._eps()
        with pytest.raises(
            ValueError, match=r"dst_pages must hold logical pages in \[0, 8\), got dst_pages containing 8"
        ):
            plan_request([0, 1], [0, 8], prefill=pre, decode=dec)
        with pytest.raises(ValueError, match=r"src_pages must not repeat a page, got page 1 more than once"):
            plan_request([1, 1], [0, 2], prefill=pre, decode=dec)
        with pytest.raises(TypeError, match=r"src_pages must hold ints, got 0.5"):
            plan_request([0.5], [0], prefill=pre, decode=dec)

    def test_rejects_layout_and_layer_mismatch(self):
        other = {
            "kv": MLAFp8Layout(page_size=8, kv_lora_rank=32, rope_dim=8, quant_block=16),
            "index": _layouts()["index"],
        }
        pre, dec = self._eps(dec_layouts=other)
        with pytest.raises(ValueError, match=r"layout of buffer 'kv' must match on every rank"):
            plan_request([0], [0], prefill=pre, decode=dec)
        pre, dec = self._eps(dec_layers=3)
        with pytest.raises(
            ValueError, match=r"num_layers must match on every rank, got 2 \(prefill 0\) and 3 \(decode 0\)"
        ):
            plan_request([0], [0], prefill=pre, decode=dec)

    def test_rejects_page_bytes_and_local_page_counts_that_do_not_match(self):
        import dataclasses

        pre, dec = self._eps()
        kv = dec[0].buffer("kv")
        bad = [dataclasses.replace(dec[0], buffers=(dec[0].buffer("index"), dataclasses.replace(kv, page_bytes=8)))]
        with pytest.raises(ValueError, match=r"page_bytes of buffer 'kv' must match on every rank, got \d+ \(prefill 0\) "
                           r"and 8 \(decode 0\)"):  # fmt: skip
            plan_request([0], [0], prefill=pre, decode=bad)
        short = dataclasses.replace(kv, num_local_pages=7)
        bad = [dataclasses.replace(dec[0], buffers=(dec[0].buffer("index"), short))]
        with pytest.raises(ValueError, match=r"num_local_pages of buffer 'kv' must be the 8 pages its ownership gives "
                           r"decode rank 0, got num_local_pages=7"):  # fmt: skip
            plan_request([0], [0], prefill=pre, decode=bad)

    def test_accepts_layouts_that_differ_between_ranks_and_sides(self):
        """Every rank publishes its own layout; the planner pairs any two (the oracle checks the bytes)."""
        layouts = _layouts()
        own = PageOwnership(2, 8, "block")  # rank 1 holds pages 4-7: one run into decode's pages 4-7
        pre = [
            KVShard.allocate(layouts, own, r, num_layers=2, page_major=r == 1).endpoint("prefill", "p") for r in (0, 1)
        ]
        dec = [KVShard.allocate(layouts, PageOwnership(1, 8), 0, num_layers=2, page_major=True).endpoint("decode", "d")]
        plan = plan_request(np.arange(8), np.arange(8), prefill=pre, decode=dec, options=PlanOptions(staging="off"))
        per_rank = [sp.num_entries for sp in plan.senders]
        assert per_rank == [4 * 2 * 2, 2]  # layer-major rank 0: pages x layers x buffers; page-major rank 1: buffers

    def test_rejects_meta_without_rows(self):
        pre, dec = self._eps()
        with pytest.raises(
            ValueError, match=r"src_meta_slot needs metadata rows on prefill rank 0, which registered none"
        ):
            plan_request([0], [0], prefill=pre, decode=dec, src_meta_slot=0, dst_meta_slot=0)
        with pytest.raises(ValueError, match=r"must be given together"):
            plan_request([0], [0], prefill=pre, decode=dec, src_meta_slot=0)

    def test_rejects_bad_options(self):
        with pytest.raises(ValueError, match=r"staging must be one of \('auto', 'off', 'full'\), got staging='yes'"):
            PlanOptions(staging="yes")


class TestShardLayout:
    def test_page_major_shard_registers_contiguous_storage(self):
        layouts = _layouts()
        s = KVShard.allocate(layouts, PageOwnership(1, 5), 0, num_layers=3, page_major=True, staging_bytes=64)
        assert s.page_major and "page_major=True" in repr(s)
        for name, lay in layouts.items():
            assert s.buffers[name].shape == (3, 5, *lay.page_shape) and not s.buffers[name].is_contiguous()
            assert s.storage(name).shape == (5, 3, *lay.page_shape) and s.storage(name).is_contiguous()
        assert all(t.is_contiguous() for t in s.registered_tensors())
        assert {t.data_ptr() for t in s.registered_tensors()} >= {b.data_ptr() for b in s.buffers.values()}
        assert all(b.page_major for b in s.endpoint("prefill", "p").buffers)

    def test_rejects_a_buffer_of_the_other_layout(self):
        layouts = _layouts()
        own = PageOwnership(1, 5)
        lm = {n: torch.zeros((3, 5, *lay.page_shape), dtype=lay.dtype) for n, lay in layouts.items()}
        with pytest.raises(ValueError, match=r"buffers\['kv'\] must be the \[num_layers, num_local_pages, \.\.\.\] view "
                           r"of a contiguous \[num_local_pages, num_layers, \.\.\.\] tensor"):  # fmt: skip
            KVShard(lm, layouts, own, 0, page_major=True)
        pm = {n: b.transpose(0, 1).contiguous().transpose(0, 1) for n, b in lm.items()}
        with pytest.raises(ValueError, match=r"buffers\['kv'\] must be contiguous"):
            KVShard(pm, layouts, own, 0)
        with pytest.raises(TypeError, match=r"page_major must be a bool, got page_major='yes'"):
            KVShard(lm, layouts, own, 0, page_major="yes")


class TestCoalesce:
    def test_page_runs_need_both_sides_contiguous(self):
        s0, d0, n = page_runs(np.array([5, 1, 2, 3, 6]), np.array([9, 1, 2, 7, 10]))
        assert list(zip(s0.tolist(), d0.tolist(), n.tolist())) == [(1, 1, 2), (3, 7, 1), (5, 9, 2)]

    def test_coalesce_entries_merges_chains_only(self):
        entries = np.array([10, 0, 20, 40]), np.array([110, 100, 130, 140]), np.array([10, 10, 20, 5])
        s, d, n = coalesce_entries(*entries)  # 0->100 and 10->110 chain; the others break on the dst side
        assert (s.tolist(), d.tolist(), n.tolist()) == ([0, 20, 40], [100, 130, 140], [20, 20, 5])

    def test_split_batches(self):
        assert split_batches(0, 1024) == []
        assert [(s.start, s.stop) for s in split_batches(2049, 1024)] == [(0, 1024), (1024, 2048), (2048, 2049)]
        with pytest.raises(ValueError, match=r"max_entries must be >= 1, got max_entries=0"):
            split_batches(3, 0)


class TestVocabulary:
    """The transfer vocabulary is "layer group": 0.1's "chunk" names are gone (a token chunk is the only chunk)."""

    def test_layer_groups_are_the_one_name(self):
        layouts = _layouts()
        pre = [
            KVShard.allocate(layouts, PageOwnership(2, 16), r, num_layers=NUM_LAYERS, staging_bytes=1 << 16)
            for r in range(2)
        ]
        dec = [KVShard.allocate(layouts, PageOwnership(1, 16), 0, num_layers=NUM_LAYERS, staging_bytes=1 << 16)]
        opts = PlanOptions(layer_groups=3, staging="full")
        with pytest.raises(TypeError, match="layer_chunks"):
            PlanOptions(layer_chunks=3)
        plan = plan_request(
            np.arange(6),
            np.arange(6),
            prefill=[s.endpoint("prefill", "p") for s in pre],
            decode=[s.endpoint("decode", "d") for s in dec],
            options=opts,
        )
        peer = plan.senders[0].peers[0]
        assert plan.num_layer_groups == 3 and peer.group_indptr.shape == (4,)
        assert peer.group(1) == slice(int(peer.group_indptr[1]), int(peer.group_indptr[2]))
        assert not hasattr(plan, "num_chunks")
        assert not any(hasattr(peer, gone) for gone in ("chunk_indptr", "chunk"))
