"""``python -m dtkv.demo``'s entry point: parse, start the groups, report (see :mod:`dtkv.demo`)."""

from __future__ import annotations

import json
import sys
import time

from dtkv._log import progress, setup_cli_logging
from dtkv.demo._args import parse

__all__ = ["main"]

_DESCRIPTION = (
    "Chunked CP prefill and decode of a DSA model on page-ownership-sharded KV, every phase checked: the reference "
    "model against the replicated-KV baseline, a transformers model against its own forward; --multi-turn with and "
    "without the prefix cache; --pd into a decode group of --decode-cp ranks. Progress on stderr; exit code 1 on "
    "any mismatch."
)


def _usage_error(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


def _start_decode(args: dict):
    from dtkv.demo._models import prompts, vocab_of
    from dtkv.demo._pd import start_decode_group

    return start_decode_group(args, prompts(args["tokens"], args["requests"], vocab_of(args), args["seed"]))


def main(argv: list[str] | None = None) -> int:
    """Run the demo (see :mod:`dtkv.demo`); returns the exit code (0 parity, 1 mismatch, 2 usage error)."""
    args, error = parse(argv, _DESCRIPTION)
    if error:
        return _usage_error(error)
    setup_cli_logging()
    import torch

    env = args.pop("torchrun")
    if args["device"] == "auto":
        want = env[2] + 1 if env is not None else args["cp"]
        args["device"] = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= want else "cpu"
    from dtkv.demo._launch import join_torchrun, spawn

    if env is not None:
        rank = env[0]
        results, wall, pd = join_torchrun(args, rank, args["cp"], env[2], start_decode=_start_decode)
    else:
        rank, pd = 0, _start_decode(args) if args["pd"] else None
        if pd is not None:
            args.update(pd.rank_args)
        t0 = time.perf_counter()
        results = spawn(args)
        wall = time.perf_counter() - t0
    return _report(args, results, wall, pd, printing=rank == 0)  # one job, one report: rank 0 prints


def _report(args: dict, results: list[dict], wall: float, pd, *, printing: bool) -> int:
    """Print the table or the JSON object of a finished run; the exit code (0 parity, 1 otherwise).

    Every torchrun rank computes the verdict from the same gathered results (the same exit code everywhere); only
    rank 0, which hosts the decode group of ``--pd``, adds its verdict and prints.
    """
    from dtkv.demo._report import print_table, summary

    errors = [r for r in results if "error" in r]
    if errors:
        if printing:
            for e in errors:
                print(f"rank {e['rank']} failed: {e['error']}", file=sys.stderr)
            if args["json"]:
                print(json.dumps({"parity": False, "cp": args["cp"], "error": errors[0]["error"].splitlines()[0]}))
        if pd is not None:
            pd.result(timeout_s=5.0)
        return 1
    pd_result = None
    if pd is not None:
        progress("waiting for the decode group")
        pd_result = pd.finish(results, timeout_s=args["timeout"])
    s = summary(args, results, wall, pd_result)
    if printing:
        if args["json"]:
            print(json.dumps(s))
        else:
            print_table(s)
    return 0 if s["parity"] else 1
