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


def _queries(n=3, heads=4, j=16, *, unrounded, seed=0, dtype=torch.bfloat16):
    from dtkv.decode import DecodeQueries

    g = torch.Generator().manual_seed(seed)
    iq = torch.randn(n, heads, j, generator=g).to(dtype)
    iq[0, 0] = 0  # an all-zero row
    z = torch.zeros(n, 2, 3)
    return DecodeQueries(iq=iq, iw=torch.rand(n, heads, generator=g), q_nope=z, q_rope=z, iq_fp8=True,
                         iq_unrounded=unrounded)  # fmt: skip


def test_unrounded_indexer_queries_are_rounded_to_fp8_rows():
    """Each row in e4m3 with the scale ``amax / 448`` (an independent formula), float32; rounded queries pass."""
    from dtkv.runtime._decode import rounded_queries

    q = _queries(unrounded=True)
    got = rounded_queries(q)
    x = q.iq.float()
    scale = x.abs().amax(-1, keepdim=True) / 448
    want = torch.where(scale > 0, (x / torch.where(scale > 0, scale, 1)).to(torch.float8_e4m3fn).float() * scale, 0)
    assert got.iq.dtype == torch.float32 and not got.iq_unrounded and got.iq_fp8
    torch.testing.assert_close(got.iq, want, rtol=0, atol=0)
    assert got.iw is q.iw and got.q_nope is q.q_nope
    done = _queries(unrounded=False, dtype=torch.float32)
    assert rounded_queries(done) is done


def test_a_step_that_rounds_in_its_kernel_takes_the_models_queries_as_they_are(monkeypatch):
    """Sharded decode of the transformers model with fp8 indexer queries: a step whose indexer kernel rounds the
    queries (Triton's, under the interpreter here; on a GPU the default) takes them unrounded, with no torch
    rounding pass before it; the torch step gets them rounded. Both decode the same tokens."""
    pytest.importorskip("transformers", reason="the hf extra (transformers==5.17.0)")
    from tests.ops_reference import skip_unless

    skip_unless("triton", "cpu")
    import dataclasses

    import dtkv.runtime._decode as D
    from dtkv.integrations.transformers import TransformersAdapter, indexer_precision, tiny_model
    from dtkv.kvio import round_trip
    from dtkv.layouts import IndexerFp8Layout
    from dtkv.runtime import Runtime, num_pages_for

    seen, real_inputs, real_config = [], D.StepInputs, D.step_config
    monkeypatch.setattr(D, "StepInputs", lambda **kw: seen.append(kw["iq"]) or real_inputs(**kw))
    lm = tiny_model("deepseek-v32", num_hidden_layers=2, dtype=torch.float32)
    prompts = [list(range(3, 30)), list(range(40, 53))]
    pages = num_pages_for([len(p) for p in prompts], page_size=4, decode_steps=3)
    out, rounded = {}, {}
    for kernel in (False, True):
        if kernel:  # the GPU's step: Triton's indexer, queries rounded in the kernel
            monkeypatch.setattr(D, "step_config", lambda **kw: dataclasses.replace(real_config(**kw), indexer="triton",
                                                                                q_fp8=True))  # fmt: skip
        seen.clear()
        with (
            indexer_precision("fp8"),
            Runtime(
                TransformersAdapter(lm, kv_dtype="fp8", page_size=4),
                num_pages=pages,
                attention="triton",
                decode_mode="sharded",
            ) as rt,
        ):
            for p in prompts:
                rt.add_request(p)
            rt.prefill(16)
            out[kernel] = rt.decode(3)
        lay = IndexerFp8Layout(page_size=1, head_dim=seen[0].shape[-1])
        rounded[kernel] = [torch.equal(iq.float(), round_trip(iq.float(), lay)) for iq in seen]
    assert seen and all(rounded[False]) and not any(rounded[True]), rounded
    assert out[True] == out[False]
