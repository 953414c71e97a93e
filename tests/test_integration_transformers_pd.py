"""PD with a transformers DSA model over loopback, once per engine (Mooncake TCP, NIXL/UCX), through the demo's
wiring (:mod:`dtkv.demo._pd`): CP prefill ranks (2 gloo ranks; also 3 with ``DTKV_TEST_LONG=1``) hand every request
to a decode group running the same model, whose received KV is bitwise what the CP ranks store and whose greedy
tokens equal the model's own. The prefill group of each size is spawned once for both engines (its processes keep
the model)."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("transformers", reason="the hf extra (transformers==5.17.0)")

from tests._multirank import RankGroup  # noqa: E402
from tests.test_integration_transformers import model, prompts, reference  # noqa: E402

pytestmark = [pytest.mark.multirank]

STEPS = 3


@pytest.fixture(scope="module")
def groups():
    made: dict[int, RankGroup] = {}

    def get(world: int) -> RankGroup:
        if world not in made:
            made[world] = RankGroup(world, timeout_s=600)
        return made[world]

    yield get
    for g in made.values():
        g.close()


def _prefill_rank(rank, world, args):
    import torch.distributed as dist

    from dtkv.demo._pd import send_from_rank
    from dtkv.integrations.transformers import TransformersAdapter
    from dtkv.runtime import Runtime, num_pages_for

    ps = prompts()
    rt = Runtime(
        TransformersAdapter(model(args["model"]), kv_dtype=args["kv_dtype"], page_size=args["page_size"]),
        group=dist.group.WORLD, split=args["split"],
        num_pages=num_pages_for([len(p) for p in ps], page_size=args["page_size"], cp_size=world),
    )  # fmt: skip
    for p in ps:
        rt.add_request(p)
    rt.prefill(48)
    report = send_from_rank(rt, args)
    rt.close()
    return {**report, "first": [r.output[0] for r in rt.requests], "outputs": None}


@pytest.mark.parametrize(
    ("world", "name", "split", "kv_dtype", "decode_cp"),
    [
        (2, "deepseek-v32", "zigzag", "fp8", 2),  # into a decode group of 2 that decodes on its shards
        # owner-filtered prefill into a sharded decode group; slow on 2 cores (the torchrun demo test covers PD too)
        pytest.param(
            3, "glm5", "round_robin", "bf16", 2,
            marks=pytest.mark.skipif(os.environ.get("DTKV_TEST_LONG", "0") != "1", reason="set DTKV_TEST_LONG=1"),
        ),
    ],
    ids=["world2-deepseek-v32-direct-fp8-into-decode2", "world3-glm5-bf16-into-decode2"],
)  # fmt: skip
def test_pd_decode_continues_the_cp_prefill(groups, world, name, split, kv_dtype, decode_cp, transfer_engine):
    from dtkv.demo._pd import start_decode_group

    args = {
        "model": name, "seed": 0, "dtype": None, "page_size": 4, "kv_dtype": kv_dtype, "split": split,
        "decode_steps": STEPS, "timeout": 120.0, "decode": "sharded", "decode_cp": decode_cp, "attention": "torch",
        "transfer_engine": transfer_engine,
    }  # fmt: skip
    decode = start_decode_group(args, prompts())
    results = groups(world).run(_prefill_rank, {**args, **decode.rank_args})
    answers = decode.result(timeout_s=300.0)
    assert all("error" not in a for a in answers), answers
    assert all(a["kv_digest"] == r["pd_kv_digest"] for a in answers for r in results), "decode holds other bytes"
    assert sum(r["pd_bytes"] for r in results) > 0
    for i, p in enumerate(prompts()):  # decode's greedy continuation is the model's own
        out = answers[0]["outputs"][i]
        assert out[0] == results[0]["first"][i]
        ref = reference(name, kv_dtype, tuple(p + out[:-1]))
        assert ref[len(p) - 1 :].argmax(-1).tolist() == out
