"""``dtkv::pack_layer_pages``: one launch packs the same send list out of every layout of a layer.

Contract: ``out_k[m]`` holds the bytes of ``pools_k[send_idx[m]]``, a zero page where ``send_idx[m]`` is ``-1`` or
``>= P``; pages are copied as words, never converted. Checked bitwise against a loop over rows. opcheck, fullgraph
compile and strided ``send_idx``: ``tests/test_ops_contracts.py``.
"""

from __future__ import annotations

import pytest
import torch

from dtkv.ops.pack_layer_pages import MAX_LAYOUTS, pack_layer_pages, pack_layer_pages_into
from tests.ops_reference import BACKENDS, DEVICES, assert_same_bytes, layer_pools, skip_unless


def _reference(pools, send_idx):
    outs = []
    for pool in pools:
        out = torch.zeros((len(send_idx), *pool.shape[1:]), dtype=pool.dtype)
        for m, page in enumerate(send_idx):
            if 0 <= page < pool.shape[0]:
                out[m] = pool[page]
        outs.append(out)
    return outs


CASES = [
    pytest.param(6, [3, -1, 0, 5, 9, 2], ("fp8-row", "indexer"), id="dsa-layer-with-padding"),
    pytest.param(1, [0], ("bf16-row",), id="one-page"),
    pytest.param(0, [-1, 0, 1], ("fp8-row", "indexer"), id="empty-rank"),
    pytest.param(7, [], ("fp8-row", "indexer"), id="nothing-to-send"),
    pytest.param(11, list(range(10, -1, -2)), ("fp8-row", "bf16-row", "indexer", "odd"), id="four-layouts"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("num_local", "send", "kinds"), CASES)
def test_pack_layer_pages_vs_reference(device, backend, num_local, send, kinds):
    skip_unless(backend, device)
    pools = layer_pools(num_local, len(send), kinds)
    idx = torch.tensor(send, dtype=torch.int64)
    want = _reference(pools, send)
    got = pack_layer_pages([p.to(device) for p in pools], idx.to(device), backend=backend)
    assert len(got) == len(pools)
    for g_, w, p in zip(got, want, pools):
        assert g_.shape == w.shape and g_.dtype == p.dtype
        assert_same_bytes(g_.cpu(), w)
    # into preallocated (dirty) buffers, int32 indices
    outs = [torch.full_like(w, 7).to(device) for w in want]
    pack_layer_pages_into(outs, [p.to(device) for p in pools], idx.to(device, torch.int32), backend=backend)
    for o, w in zip(outs, want):
        assert_same_bytes(o.cpu(), w)


def test_rejects_bad_input_and_leaves_outputs_untouched():
    pools = layer_pools(4, 2, ("fp8-row", "indexer"))
    with pytest.raises(ValueError, match="pools must share their local page count, got pools\\[0\\].shape\\[0\\]=4"):
        pack_layer_pages([pools[0], pools[1][:3]], torch.tensor([0]))
    with pytest.raises(ValueError, match=f"pools must be a list of 1 to {MAX_LAYOUTS} tensors"):
        pack_layer_pages(pools * 3, torch.tensor([0]), backend="torch")
    with pytest.raises(TypeError, match="send_idx must have dtype"):
        pack_layer_pages(pools, torch.tensor([0.0]))
    outs = [torch.full((2, *p.shape[1:]), 9, dtype=p.dtype) for p in pools]
    with pytest.raises(ValueError, match="outs\\[1\\] must have shape"):
        pack_layer_pages_into([outs[0], outs[1][:1]], pools, torch.tensor([0, 1]))
    assert all(bool((o == 9).all()) for o in outs)
