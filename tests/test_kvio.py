"""``dtkv.kvio.random_pages``: random stored bytes that decode to finite rows, with the scales asked for."""

from __future__ import annotations

import pytest
import torch

from dtkv import IndexerFp8Layout, MLAFp8Layout, MLALatentLayout
from dtkv.kvio import random_pages, read_rows

LAYOUTS = {
    "mla_fp8": MLAFp8Layout(page_size=3, kv_lora_rank=64, rope_dim=16, quant_block=32),
    "indexer_fp8": IndexerFp8Layout(page_size=5, head_dim=32),
    "latent_bf16": MLALatentLayout(page_size=4, kv_lora_rank=8, rope_dim=4, store_dtype=torch.bfloat16),
}


def _pages(layout, num_pages: int = 7) -> torch.Tensor:
    return torch.zeros(num_pages, *layout.page_shape, dtype=layout.dtype)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_random_pages_decode_to_finite_rows_and_repeat_with_the_seed(name):
    layout = LAYOUTS[name]
    a, b = _pages(layout), _pages(layout)
    random_pages(a, layout, torch.Generator().manual_seed(3))
    random_pages(b, layout, torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and a.any()
    rows = read_rows(a, layout, torch.float64)
    assert rows.shape[0] == a.shape[0] * layout.page_size and torch.isfinite(rows).all()
    assert rows.abs().amax() > 0


@pytest.mark.parametrize("name", ["mla_fp8", "indexer_fp8"])
def test_fp8_codes_skip_the_nan_patterns_and_scales_lie_in_the_range(name):
    layout = LAYOUTS[name]
    pages = _pages(layout, 40)
    random_pages(pages, layout, torch.Generator().manual_seed(0), scales=(0.25, 0.5))
    if isinstance(layout, MLAFp8Layout):
        codes = pages[..., : layout.kv_lora_rank]
        scales = pages[..., layout.scale_offset : layout.rope_offset].contiguous().view(torch.float32)
        rope = pages[..., layout.rope_offset :].contiguous().view(torch.bfloat16)
        assert torch.isfinite(rope).all() and rope.std() > 0.5
    else:
        codes = pages[:, : layout.scale_offset]
        scales = pages[:, layout.scale_offset :].contiguous().view(torch.float32)
    assert not ((codes & 0x7F) == 0x7F).any()  # 0x7F / 0xFF: NaN in e4m3fn
    assert len(torch.unique(codes)) == 254  # every other byte occurs
    assert bool(((scales >= 0.25) & (scales <= 0.5)).all())


def test_random_pages_refuses_a_layout_it_cannot_fill():
    with pytest.raises(TypeError, match="layout must be an MLA or indexer layout, got"):
        random_pages(torch.zeros(1, 4, dtype=torch.uint8), object(), torch.Generator())  # type: ignore[arg-type]
