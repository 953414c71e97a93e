"""``dtkv.attention._rows.page_rows``: a layer of a page-major pool as rows without a copy, against the flattened
copy it replaces (every slot, ``-1``, slots past the pages, one page, a layer-major view, a page stride that is not
a whole number of rows), and the torch and Triton backends on a page-major layer view: the same outputs, bitwise, as
on a contiguous copy of that layer, and no copy of the layer's pages made."""

from __future__ import annotations

import pytest
import torch

from dtkv import MLAFp8Layout, MLALatentLayout
from dtkv.attention import AttentionSpec, resolve_attention
from dtkv.attention._rows import page_rows
from dtkv.ops import quantize_mla_fp8
from tests.ops_reference import backend_ok

FP8 = MLAFp8Layout(page_size=4, kv_lora_rank=64, rope_dim=16, quant_block=32)
BF16 = MLALatentLayout(page_size=4, kv_lora_rank=64, rope_dim=16)
TRITON = pytest.mark.skipif(not backend_ok("triton", "cpu"), reason="needs Triton in interpreter mode")


def _page_major(layout, num_pages: int, num_layers: int, seed: int) -> torch.Tensor:
    """Storage ``[P, num_layers, S, row]`` of random rows in ``layout``'s format."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randn(num_pages * num_layers * layout.page_size, layout.kv_lora_rank + layout.rope_dim, generator=g)
    rows = quantize_mla_fp8(src, layout) if isinstance(layout, MLAFp8Layout) else src.to(layout.dtype)
    return rows.view(num_pages, num_layers, layout.page_size, -1)


def _slots(n: int, w: int, num_slots: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(-1, num_slots + 3, (n, w), generator=g)  # -1 and a few past the slots: none
    idx[0, :3] = torch.tensor([0, num_slots - 1, -1])
    return idx.to(torch.int32)


@pytest.mark.parametrize("num_pages", [1, 2, 7])
@pytest.mark.parametrize("layer", [0, 2])
def test_page_major_layer_rows_are_the_flattened_layer_without_a_copy(num_pages, layer):
    store = _page_major(BF16, num_pages, 3, seed=num_pages)
    kv = store[:, layer]  # [P, S, row], pages 3 pages apart
    idx = _slots(5, 9, num_pages * 4, seed=layer)
    rows, moved = page_rows(kv, idx)
    flat = kv.reshape(-1, kv.shape[-1])
    valid = (idx >= 0) & (idx < flat.shape[0])
    assert torch.equal(rows[moved[valid].long()], flat[idx[valid].long()])
    assert moved.dtype == idx.dtype
    if num_pages == 1:  # one page is one run of rows: flattened, the indices as they are (past the rows: none)
        assert moved is idx
        return
    assert torch.equal(moved < 0, ~valid), "a slot that was none became a row"
    assert rows.untyped_storage().data_ptr() == store.untyped_storage().data_ptr(), "the pages were copied"
    assert rows.shape[0] == (num_pages - 1) * 3 * 4 + 4  # through the last page's last row


def test_layer_major_and_odd_strides_keep_the_indices():
    lay = torch.arange(2 * 5 * 4 * 6, dtype=torch.float32).view(2, 5, 4, 6)[1]  # a layer-major layer: one run
    idx = _slots(3, 4, 20, seed=1)
    rows, same = page_rows(lay, idx)
    assert same is idx and rows.data_ptr() == lay.data_ptr() and rows.shape == (20, 6)
    odd = torch.zeros(5, 4 * 6 + 3)[:, : 4 * 6].view(5, 4, 6)  # pages 27 elements apart: not whole rows
    rows, same = page_rows(odd, idx)
    assert same is idx and torch.equal(rows, odd.reshape(-1, 6))


@pytest.mark.parametrize("name", ["torch", pytest.param("triton", marks=TRITON)])
@pytest.mark.parametrize("layout", [FP8, BF16], ids=["fp8", "bf16"])
def test_backends_on_a_page_major_layer_equal_a_contiguous_copy(name, layout, monkeypatch):
    store = _page_major(layout, 6, 3, seed=4)
    kv = store[:, 1]
    spec = AttentionSpec(num_heads=4, layout=layout, topk=12)
    backend = resolve_attention(name, spec=spec, device="cpu")
    g = torch.Generator().manual_seed(5)
    q = (torch.randn(5, 4, 80, generator=g) / 2).to(torch.float64 if name == "torch" else torch.float32)
    idx = _slots(5, 12, 24, seed=6)
    want = backend.prefill(q, kv.contiguous(), idx, softmax_scale=0.1)
    import dtkv.attention._rows as rows_mod

    seen = []
    real = rows_mod.page_rows

    def spy(kv_arg, indices):
        out = real(kv_arg, indices)
        seen.append(out[0].untyped_storage().data_ptr() == store.untyped_storage().data_ptr())
        return out

    monkeypatch.setattr(f"dtkv.attention._{name}.page_rows", spy)
    got = backend.prefill(q, kv, idx, softmax_scale=0.1)
    assert seen == [True], "the backend copied the layer's pages"
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16"])
@pytest.mark.parametrize("entry", ["prefill", "decode"])
def test_flashmla_seam_on_a_page_major_layer_equals_a_contiguous_copy(kv_dtype, entry, monkeypatch):
    """The FlashMLA backend (against the stand-in ``tests/fake_flash_mla.py``) on a page-major layer view: the
    outputs of a contiguous copy of the layer, bitwise (bf16 reads the pages through :func:`page_rows`; fp8 decode
    hands the kernel the page-strided pages as they are)."""
    import dtkv.attention._flashmla as fm
    import dtkv.attention._resolve as res
    import tests.fake_flash_mla as fake

    monkeypatch.setattr(fm, "availability", lambda name, device: "")
    monkeypatch.setattr(res, "availability", lambda name, device: "")
    monkeypatch.setattr(fm, "flashmla_module", lambda: (fake, ""))
    layout = MLAFp8Layout(page_size=64) if kv_dtype == "fp8" else MLALatentLayout(page_size=64)
    backend = resolve_attention("flashmla", spec=AttentionSpec(num_heads=64, layout=layout, topk=100), device="cpu")
    kv = _page_major(layout, 4, 2, seed=7)[:, 1]
    g = torch.Generator().manual_seed(8)
    q = (torch.randn(5, 64, 576, generator=g) / 4).to(torch.bfloat16)
    idx = backend.indices(torch.randint(-1, 4 * 64, (5, 100), generator=g), kv)
    args = {"softmax_scale": 0.05}
    if entry == "decode":
        args["schedule"] = backend.plan_decode(5, idx.shape[1])
    got = getattr(backend, entry)(q, kv, idx, **args)
    if entry == "decode":
        args["schedule"] = backend.plan_decode(5, idx.shape[1])
    want = getattr(backend, entry)(q, kv.contiguous(), idx, **args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
