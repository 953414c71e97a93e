"""``--cp 1``: one process runs every model in every mode of the demo, and the runtime runs every KV mode without a
group (the natural first run of a user with one machine or one GPU).

Each demo case runs one rank in this process (:func:`dtkv.demo._run.run_rank` with no group, as ``--cp 1`` spawns
it) and must pass every check the demo reports: the reference model against its replicated-KV baseline (which at
cp=1 is ``mode="replicated"`` without a group, the path that raised ``AssertionError: only CP modes gather rows``),
a transformers model against its own forward. The CLI itself runs once, as a user starts it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests._failure import failure_text
from tests._runtime import runtime

MODELS = ["reference", "deepseek-v32", "glm5"]
MODES = {
    "default": [],
    "sharded_decode": ["--decode", "sharded"],
    "fp8": ["--kv-dtype", "fp8"],
    "round_robin": ["--split", "round_robin"],
    "multi_turn": ["--multi-turn", "--turns", "2", "--shared-requests", "2"],
    "triton": ["--attention", "triton"],  # the Triton interpreter here (TRITON_INTERPRET=1, tests/conftest.py)
}


def _args(model: str, extra: list[str]) -> dict:
    from dtkv.demo._args import parse

    args, error = parse(["--model", model, "--cp", "1", "--tokens", "96", "--chunk", "32", "--decode-steps", "2",
                         *extra])  # fmt: skip
    assert error is None, error
    args.pop("torchrun")
    args["device"] = "cpu"
    return args


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("model", MODELS)
def test_one_process_runs_every_model_in_every_mode(model, mode):
    from dtkv.demo._run import run_rank

    res = run_rank(0, 1, _args(model, MODES[mode]), None, torch.device("cpu"))
    assert "error" not in res and res["checks"], res
    for name, check in res["checks"].items():
        assert check["ok"], (name, check)


def test_demo_cli_at_cp_1_reports_parity():
    out = subprocess.run([sys.executable, "-m", "dtkv.demo", "--cp", "1", "--json", "--tokens", "200", "--chunk", "64"],
                         capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert out.returncode == 0, failure_text(out)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["parity"] is True and res["cp"] == 1 and "error" not in res, res


@pytest.mark.mooncake
@pytest.mark.slow  # a decode process and a Mooncake engine: > 10 s on 2 cores
def test_demo_cli_at_cp_1_hands_off_to_a_decode_process():
    pytest.importorskip("mooncake.engine", reason="the Mooncake transfer engine (non-cuda wheel + libibverbs1)")
    out = subprocess.run([sys.executable, "-m", "dtkv.demo", "--cp", "1", "--pd", "--json", "--tokens", "200",
                          "--chunk", "64"], capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert out.returncode == 0, failure_text(out)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["parity"] is True and res["pd_parity"] is True and res["cp"] == 1, res


@pytest.mark.parametrize(
    ("mode", "decode_mode"),
    [
        (m, d)
        for m in ("replicated", "sharded", "sharded_direct")
        for d in ("full", "sharded")
        if (m, d) != ("replicated", "sharded")
    ],
)
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.filterwarnings("error::DeprecationWarning")  # the runtime's own calls use no deprecated name
def test_every_kv_mode_without_a_group_is_the_single_mode(model, mode, decode_mode):
    """A CP mode of no group stores what ``mode="single"`` stores and decodes the same tokens, bitwise: nothing is
    exchanged (sharded decode needs a page-sharded pool: not with ``replicated``)."""
    split = "round_robin" if mode == "sharded" else "zigzag"
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (11, 5, 1)]
    runs = []
    for m in ("single", mode):
        rt = runtime(model, num_pages=32, mode=m, split=split, decode_mode=decode_mode)
        try:
            for p in prompts:
                rt.add_request(p)
            rt.prefill(4)
            outputs = rt.decode(3)
            runs.append((outputs, [rt.kv_bytes(r.rid) for r in rt.requests], rt.mode))
        finally:
            rt.close()
    (want, want_kv, _), (got, got_kv, got_mode) = runs
    assert got_mode == mode and got == want
    for a, b in zip(got_kv, want_kv):
        assert all(torch.equal(a[n], b[n]) for n in a)


def test_a_step_context_needs_one_step():
    """``StepContext`` (public: an adapter's tests build one, ``Runtime.context(plan)``) refuses to be built without
    a step instead of an ``assert`` firing later in ``ctx.ids``."""
    from dtkv.runtime import StepContext

    rt = runtime("reference", num_pages=8)
    try:
        parts = dict(pool=rt.pool, mode=rt.mode, group=rt.group, ownership=rt.ownership, spec=rt.ownership_spec,
                     attention=rt.attention)  # fmt: skip
        with pytest.raises(ValueError, match=r"StepContext needs one step: .* got plan=None, sharded=None"):
            StepContext(**parts)
        rt.add_request([1, 2, 3])
        plan = rt.plan_step(rt.requests, [3])
        assert rt.context(plan).ids.tolist() == [1, 2, 3]
        assert StepContext(**parts, plan=plan).ids.tolist() == [1, 2, 3]
    finally:
        rt.close()
