"""The demo's command line: every flag for every model, with its default and unit, and the rules between flags.

:func:`parse` returns the arguments as a plain dict (what every rank and the decode group receive) or a usage
error (exit code 2): a flag out of range, flags that contradict each other, a checkpoint directory that is not
one (its ``config.json`` missing, unreadable, not an object, of another ``model_type`` or without ``vocab_size``).
Imports nothing heavy: ``--help`` and usage errors are quick. What needs torch (the device, the attention
backend's availability) is checked by :mod:`dtkv.demo._cli` before any rank starts.

``--model NAME`` takes the built-in names as people type them (``glm-5``, ``GLM5``, ``deepseek-v3.2``). A name
that is also a directory holding a ``config.json`` (a checkpoint saved as ``./glm5``) loads that directory, as
transformers' ``from_pretrained`` prefers a local directory to a hub name, and the run says so on stderr; the
built-in model is the name typed where no such directory exists.
"""

from __future__ import annotations

import argparse
import json
import math
import os

from dtkv._names import canonical_name

__all__ = ["CHECKPOINT_MODEL_TYPES", "MODELS", "checkpoint_config", "parse", "parser"]

MODELS = ("reference", "deepseek-v32", "glm5")
"""The built-in models: the float64 reference model and two tiny random transformers DSA models (no download)."""
CHECKPOINT_MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa")
"""``config.json`` ``model_type`` values a checkpoint directory may have (DeepSeek-V3.2, GLM-5): the families of
:mod:`dtkv.integrations.transformers` (a test keeps the two lists equal)."""
ATTENTION = ("torch", "triton", "flashmla")
"""Attention backends a run can choose (``--attention``; :mod:`dtkv.attention`)."""


def parser(description: str = "", prog: str = "python -m dtkv.demo") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description)
    a = p.add_argument
    a(
        "--model",
        default=None,
        metavar="{reference,deepseek-v32,glm5,PATH}",
        help="the float64 reference model, a tiny random transformers DSA model, or a checkpoint directory "
        "(DeepSeek-V3.2 / GLM-5, as save_pretrained writes it; a directory named like a built-in model is "
        "taken when it holds a config.json) (default: reference)",
    )
    a("--cp", type=int, default=None, help="CP ranks of the prefill group (default: 2; under torchrun its WORLD_SIZE)")
    a("--tokens", type=int, default=1536, help="prompt tokens over all requests (default: 1536)")
    a("--requests", type=int, default=2, help="requests in the batch, of lengths 3:2:1... (default: 2)")
    a("--chunk", type=int, default=256, help="prefill chunk: tokens per request per step (default: 256)")
    a("--page-size", type=int, default=16, help="tokens per KV page (default: 16)")
    a(
        "--kv-dtype",
        choices=("bf16", "fp8", "fp32"),
        default="bf16",
        help="stored KV format; fp32 only for transformers models (default: bf16)",
    )
    a(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="dtype of a transformers model (default: float32 for the tiny models, bfloat16 with --attention "
        "flashmla, the checkpoint's for a PATH)",
    )
    a(
        "--split",
        choices=("zigzag", "round_robin"),
        default="zigzag",
        help="CP split of each step's tokens; zigzag is page-aligned where possible (direct writes) (default: zigzag)",
    )
    a("--decode-steps", type=int, default=4, help="greedy decode steps after prefill (default: 4)")
    a(
        "--decode",
        choices=("full", "sharded"),
        default="full",
        help="decode over a materialized full view, or straight on the shards (no view) (default: full)",
    )
    a(
        "--attention",
        choices=ATTENTION,
        default="torch",
        help="attention backend of prefill and full-view decode (dtkv.attention); flashmla runs a built-in model at "
        "FlashMLA's dims: 64 heads, kv_lora_rank 512, rope 64, pages of 64 tokens (default: torch, the reference)",
    )
    a(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: CUDA when enough GPUs are visible, else CPU with gloo (default: auto)",
    )
    a("--seed", type=int, default=0, help="seed of the prompts and of the tiny models' weights (default: 0)")
    a("--timeout", type=float, default=300.0,
      help="seconds before the ranks are given up on, positive and finite (default: 300 s)")  # fmt: skip
    a("--json", action="store_true", help="print one JSON object on stdout (progress lines go to stderr)")
    a("--pd", action="store_true", help="also hand every request to a decode group (loopback, --transfer-engine)")
    a(
        "--transfer-engine",
        choices=("mooncake", "nixl"),
        default="mooncake",
        help="with --pd: the transfer engine, Mooncake (TCP) or NIXL (UCX) (default: mooncake)",
    )
    a(
        "--decode-cp",
        type=int,
        default=1,
        help="with --pd: ranks of the decode group, which decodes on its own shards (default: 1, one process)",
    )
    a(
        "--decode-device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="with --pd: where the decode group runs; cuda puts decode rank d on GPU d mod the GPU count (one GPU "
        "may serve prefill and decode; NCCL among decode ranks needs --decode-cp distinct GPUs); auto: cuda when "
        "--device is cuda and there are --decode-cp GPUs, else cpu (default: auto)",
    )
    a(
        "--page-major",
        nargs="?",
        const="both",
        choices=("both", "prefill", "decode"),
        default=None,
        help="store the KV pools page-major (a page's layers next to each other: a PD hand-off moves a run of pages "
        "in one entry for every layer): alone or 'both', every pool; 'prefill' or 'decode' (with --pd), that "
        "group's pools only (default: layer-major)",
    )
    a(
        "--multi-turn",
        action="store_true",
        help="a conversation and requests sharing its system prompt, with and without the prefix cache",
    )
    a("--turns", type=int, default=4, help="--multi-turn: turns of the conversation (default: 4)")
    a("--shared-requests", type=int, default=3, help="--multi-turn: requests sharing the system prompt (default: 3)")
    a(
        "--pool-pages",
        type=int,
        default=None,
        help="--multi-turn: KV pages of the cached run's pool, to make it evict (default: room for every request)",
    )
    return p  # fmt: skip


def _torchrun_env() -> tuple[int, int, int] | None:
    """``(rank, world_size, local_rank)`` when started by torchrun (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``)."""
    if not all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])


def checkpoint_config(path: str) -> tuple[dict | None, str | None]:
    """``(config.json as a dict, None)`` of a checkpoint directory, or ``(None, why it is not one)``.

    The demo reads the model's ``model_type`` (one of :data:`CHECKPOINT_MODEL_TYPES`) and ``vocab_size`` (a
    positive int) from it before any rank starts.
    """
    cfg = os.path.join(path, "config.json")
    if not os.path.isfile(cfg):
        return None, (f"--model {path} is a directory without config.json: a checkpoint directory holds "
                      "config.json and safetensors, as save_pretrained writes it")  # fmt: skip
    try:
        with open(cfg, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        return None, f"--model {path}: {cfg} is not a readable JSON file ({e})"
    if not isinstance(data, dict):
        return None, f"--model {path}: {cfg} must hold a JSON object, got a {type(data).__name__}"
    model_type = data.get("model_type")
    if model_type not in CHECKPOINT_MODEL_TYPES:
        return None, (f"--model {path}: {cfg} has model_type={model_type!r}; the demo runs the DSA models "
                      f"{list(CHECKPOINT_MODEL_TYPES)} (DeepSeek-V3.2, GLM-5)")  # fmt: skip
    vocab = data.get("vocab_size")
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        return None, f"--model {path}: {cfg} must give vocab_size as a positive int, got vocab_size={vocab!r}"
    return data, None


def _resolve_model(typed: str | None) -> tuple[str, str | None, str | None]:
    """``(model, note, error)``: a built-in name (canonical spelling) or a checkpoint directory."""
    if typed is None:
        return "reference", None, None
    builtin = canonical_name(typed, MODELS)
    if os.path.isdir(typed):
        if builtin is not None and not os.path.isfile(os.path.join(typed, "config.json")):
            return builtin, None, None  # a directory of that name that is no checkpoint: the built-in model
        _, error = checkpoint_config(typed)
        note = None
        if builtin is not None:
            note = (f"--model {typed}: loading the checkpoint directory {os.path.abspath(typed)} (it holds a "
                    f"config.json), not the built-in {builtin} model; run from another directory for "
                    "that one")  # fmt: skip
        return typed, note, error
    if builtin is not None:
        return builtin, None, None
    return typed, None, (f"--model must be one of {list(MODELS)} or a checkpoint directory, got --model {typed} "
                         "(not a directory)")  # fmt: skip


def parse(argv: list[str] | None, description: str = "", prog: str = "python -m dtkv.demo") -> tuple[dict, str | None]:
    """``(args, None)``, or ``(partial args, usage error)`` for flags that break a rule.

    ``args["model_note"]`` (popped by the caller) says when a name was taken as a directory.
    """
    ns = parser(description, prog).parse_args(argv)
    args = vars(ns)
    env = _torchrun_env()
    args["torchrun"] = env
    args["model"], args["model_note"], model_error = _resolve_model(args["model"])
    for name in ("cp", "tokens", "requests", "chunk", "page_size", "decode_cp"):
        value = args[name]
        if value is not None and value < 1:
            return args, f"--{name.replace('_', '-')} must be >= 1, got {value}"
    if args["decode_steps"] < 0:
        return args, f"--decode-steps must be >= 0, got {args['decode_steps']}"
    if not (math.isfinite(args["timeout"]) and args["timeout"] > 0):
        return args, f"--timeout must be a positive, finite number of seconds, got --timeout {args['timeout']}"
    if args["tokens"] < args["requests"]:
        return args, f"--tokens must be >= --requests, got {args['tokens']} < {args['requests']}"
    if args["multi_turn"]:
        for name in ("turns", "shared_requests", "pool_pages"):
            value = args[name]
            if value is not None and value < 1:
                return args, f"--{name.replace('_', '-')} must be >= 1, got {value}"
        if args["pd"]:
            return args, "--multi-turn and --pd are separate runs (the cached conversation stays in one group)"
    if args["decode_device"] != "auto" and not args["pd"]:
        return (
            args,
            f"--decode-device is where --pd's decode group runs: add --pd, got --decode-device {args['decode_device']}",
        )
    if args["page_major"] == "decode" and not args["pd"]:
        return args, "--page-major decode is the layout of --pd's decode group: add --pd, got --page-major decode"
    if args["decode_cp"] != 1 and not args["pd"]:
        return args, f"--decode-cp is the size of --pd's decode group: add --pd, got --decode-cp {args['decode_cp']}"
    reference = args["model"] == "reference"
    if reference and (args["kv_dtype"] == "fp32" or args["dtype"] is not None):
        return args, (
            "--kv-dtype fp32 and --dtype are for transformers models (the reference model computes in "
            f"float64 and stores bf16 or fp8), got --kv-dtype {args['kv_dtype']} --dtype {args['dtype']}"
        )
    if model_error:
        return args, model_error
    if reference and args["decode"] == "sharded" and args["attention"] != "torch":
        return args, ("--decode sharded checks the reference model's float64 decode against the torch attention's: "
                      f"drop --attention {args['attention']}")  # fmt: skip
    if args["attention"] == "flashmla" and args["model"] in MODELS:
        args["page_size"] = 64  # FlashMLA's fp8 pages hold 64 tokens (the model runs at FlashMLA's dims)
    if env is not None and args["cp"] is not None and args["cp"] != env[1]:
        return args, f"--cp must equal torchrun's WORLD_SIZE={env[1]} (or be left out), got --cp {args['cp']}"
    if env is not None and args["pd"] and os.environ.get("LOCAL_WORLD_SIZE", str(env[1])) != str(env[1]):
        return args, (
            "--pd under torchrun needs a single node (the decode group rendezvouses on 127.0.0.1), "
            f"got WORLD_SIZE={env[1]}, LOCAL_WORLD_SIZE={os.environ['LOCAL_WORLD_SIZE']}"
        )
    args["cp"] = env[1] if env is not None else (args["cp"] or 2)
    return args, None  # fmt: skip
