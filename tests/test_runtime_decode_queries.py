"""How a sharded decode step joins a layer's absorbed and rope queries (``dtkv.runtime._decode._joined_queries``):
two halves of one contiguous ``[N, H, R + E]`` buffer are read in place (the transformers model writes its latent
query beside the rope part), anything else is concatenated; the values are ``torch.cat``'s either way."""

from __future__ import annotations

import pytest
import torch

from dtkv.runtime._decode import _joined_queries


@pytest.mark.parametrize("n, h, r, e", [(1, 1, 1, 1), (3, 5, 7, 2), (2, 128, 512, 64), (0, 4, 8, 2)])
def test_halves_of_one_buffer_are_read_in_place(n, h, r, e):
    buf = torch.randn(n, h, r + e)
    got = _joined_queries(buf[..., :r], buf[..., r:])
    assert torch.equal(got, torch.cat((buf[..., :r], buf[..., r:]), dim=-1))
    if n:
        assert got.data_ptr() == buf.data_ptr()  # no copy


def _cases():
    g = torch.Generator().manual_seed(0)
    buf = torch.randn(3, 4, 12, generator=g)
    wide = torch.randn(3, 4, 14, generator=g)
    yield "separate tensors", torch.randn(3, 4, 9, generator=g), torch.randn(3, 4, 3, generator=g)
    yield "swapped halves", buf[..., 3:], buf[..., :3]
    yield "a gap between the halves", wide[..., :9], wide[..., 10:13]
    yield "rows of a wider buffer", wide[..., :9], wide[..., 9:12]
    t = torch.randn(4, 3, 12, generator=g).transpose(0, 1)
    yield "transposed buffer", t[..., :9], t[..., 9:]
    yield "other dtypes", buf[..., :9], buf[..., 9:].double()


@pytest.mark.parametrize("what, q_nope, q_rope", list(_cases()), ids=[c[0] for c in _cases()])
def test_anything_else_is_concatenated(what, q_nope, q_rope):
    got = _joined_queries(q_nope, q_rope)
    assert torch.equal(got, torch.cat((q_nope, q_rope), dim=-1)) and got.dtype == torch.cat((q_nope, q_rope), -1).dtype
    assert got.is_contiguous() and got.shape == (*q_nope.shape[:2], q_nope.shape[-1] + q_rope.shape[-1])
    assert got.data_ptr() not in (q_nope.data_ptr(), q_rope.data_ptr())  # a new buffer
