"""``load_model``: a checkpoint directory written by ``save_pretrained`` loads into the model it was saved from
(bitwise equal logits), in the dtype it ships, and runs in the runtime with parity; other models are refused."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from dtkv.integrations.transformers import load_model, reference_logits, tiny_model  # noqa: E402


@pytest.mark.parametrize("name", ["deepseek-v32", "glm5"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_saved_checkpoint_loads_into_the_same_model(tmp_path, name, dtype):
    """Weights bitwise equal in the shipped dtype. Logits bitwise equal for float32; a bfloat16 in-memory model
    (``tiny_model(..., dtype=bfloat16)`` is ``.to(bfloat16)``) also rounded its float32 buffers (rotary
    ``inv_freq``, the router's correction bias), which ``from_pretrained`` keeps in float32 as real checkpoints
    load: there the buffers must be the originals, bf16-rounded on the in-memory side only."""
    lm = tiny_model(name, seed=3, dtype=dtype)
    lm.save_pretrained(tmp_path, safe_serialization=True)
    assert list(tmp_path.glob("*.safetensors")), "save_pretrained wrote no safetensors"
    loaded = load_model(tmp_path)
    assert type(loaded) is type(lm) and not loaded.training
    assert next(loaded.parameters()).dtype == dtype  # the dtype the checkpoint ships
    for (key, a), b in zip(lm.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), key
    for (key, a), b in zip(lm.named_buffers(), loaded.buffers()):
        assert torch.equal(a, b.to(a.dtype)), key
    if dtype == torch.float32:
        ids = torch.randint(0, lm.config.vocab_size, (1, 45), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            assert torch.equal(loaded(input_ids=ids).logits, lm(input_ids=ids).logits)


def test_a_dtype_asked_for_wins_over_the_stored_one(tmp_path):
    tiny_model("glm5", dtype=torch.float32).save_pretrained(tmp_path)
    assert next(load_model(tmp_path, dtype=torch.bfloat16).parameters()).dtype == torch.bfloat16


def test_the_runtime_on_a_loaded_checkpoint_matches_its_own_forward(tmp_path):
    from dtkv.integrations.transformers import TransformersAdapter, num_pages_for
    from dtkv.runtime import Runtime

    tiny_model("deepseek-v32", seed=1).save_pretrained(tmp_path)
    lm = load_model(tmp_path)
    prompt = torch.randint(0, 256, (37,), generator=torch.Generator().manual_seed(2)).tolist()
    rt = Runtime(TransformersAdapter(lm, page_size=16, kv_dtype="fp32"),
                     num_pages=num_pages_for([37], page_size=16, decode_steps=2, cp_size=1))  # fmt: skip
    rt.add_request(prompt)
    _, logits = rt.prefill(16, return_logits=True)
    rt.close()
    ref = reference_logits(lm, prompt, layouts=rt.pool.layouts)
    assert (ref - logits[0].to(ref.dtype)).abs().max() <= 1e-5


@pytest.mark.parametrize(
    "config,match",
    [
        ({"model_type": "llama"}, r"model_type='llama'; dtkv runs the DSA models \['deepseek_v32', 'glm_moe_dsa'\]"),
        (None, "path must be a checkpoint directory holding config.json"),
    ],
)
def test_refuses_what_is_not_a_supported_checkpoint_before_loading(tmp_path, config, match):
    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=match):
        load_model(tmp_path)


def _saved(tmp_path, edit):
    """A saved tiny GLM-5 whose safetensors ``edit(state_dict)`` rewrote."""
    from safetensors.torch import load_file, save_file

    tiny_model("glm5", seed=0).save_pretrained(tmp_path)
    (f,) = tmp_path.glob("*.safetensors")
    sd = load_file(f)
    edit(sd)
    save_file(sd, f, metadata={"format": "pt"})
    return sorted(load_file(f)) if sd else []


def test_refuses_a_checkpoint_that_lacks_weights_naming_them(tmp_path):
    """``from_pretrained`` filled the missing weights with random values (each CP rank its own), so the run only
    showed a logit mismatch; now the load fails naming what is missing."""
    key = "model.layers.0.mlp.up_proj.weight"
    _saved(tmp_path, lambda sd: sd.pop(key))
    with pytest.raises(ValueError, match=rf"got 1 missing tensors \({key}\) in .*from_pretrained would fill them"):
        load_model(tmp_path)


def test_refuses_a_checkpoint_without_any_weight(tmp_path):
    _saved(tmp_path, lambda sd: sd.clear())
    with pytest.raises(ValueError, match=r"got \d+ missing tensors \(.*, \.\.\. \(\d+ more\)\)"):
        load_model(tmp_path)


def test_refuses_a_weight_of_another_shape_naming_both_shapes(tmp_path):
    key = "model.layers.0.self_attn.indexer.k_norm.bias"

    def shrink(sd):
        sd[key] = sd[key][:-1].contiguous()

    _saved(tmp_path, shrink)
    with pytest.raises(
        ValueError, match=rf"1 tensors of another shape \({key}: \[31\] in the checkpoint, \[32\] in the model\)"
    ):
        load_model(tmp_path)


@pytest.mark.parametrize(
    "text,kind", [("[1, 2]", "array"), ('"glm_moe_dsa"', "string"), ("7", "number"), ("null", "null")]
)
def test_refuses_a_config_json_that_is_not_an_object(tmp_path, text, kind):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(
        ValueError, match=rf"config.json must hold a JSON object \(the model's config\), got a JSON {kind}"
    ):
        load_model(tmp_path)
