"""``python -m dtkv.demo``'s entry point: parse, check the device, start the groups, report (see :mod:`dtkv.demo`).

Exit codes: 0 parity, 1 a mismatch (or a rank that failed), 2 a usage error -- one ``error:`` line on stderr from
this process (under torchrun from rank 0 only), never a traceback per rank: flags out of range or in conflict, a
directory that is not a supported checkpoint, ``--device cuda`` without the GPUs, an ``--attention`` backend this
device cannot run (checked here, before any rank starts), or one that does not fit the model (a rank's
:class:`dtkv.attention.AttentionFitError`).
"""

from __future__ import annotations

import json
import logging
import sys
import time

from dtkv._log import progress, setup_cli_logging
from dtkv.demo._args import parse

__all__ = ["main"]

_DESCRIPTION = (
    "Chunked CP prefill and decode of a DSA model on page-ownership-sharded KV, every phase checked: the reference "
    "model against the replicated-KV baseline, a transformers model against its own forward; --multi-turn with and "
    "without the prefix cache; --pd into a decode group of --decode-cp ranks. Progress on stderr; exit code 1 on "
    "any mismatch, 2 on a usage error."
)


def _usage_error(msg: str, *, printing: bool = True) -> int:
    if printing:  # one line per job: torchrun's other ranks stay quiet
        print(f"error: {msg}", file=sys.stderr)
    return 2


def _device_error(args: dict, want: int) -> str | None:
    """Why this machine cannot run ``args`` (``--device cuda`` without the GPUs, an ``--attention`` backend
    unavailable on the device or, with ``--pd``, on the decode group's CPU processes), or ``None``."""
    import torch

    from dtkv.attention import availability

    if args["device"] == "cuda":
        if not torch.cuda.is_available():
            return f"--device cuda needs a CUDA device, and torch {torch.__version__} sees none"
        if torch.cuda.device_count() < want:
            return f"--device cuda needs {want} visible GPU(s), one per rank, got {torch.cuda.device_count()}"
    name = args["attention"]
    why = availability(name, args["device"])
    if why:
        return f"--attention {name} is not available on {args['device']}: {why}"
    if args["pd"] and availability(name, "cpu"):
        return f"--pd decodes in CPU processes, where --attention {name} is not available: {availability(name, 'cpu')}"
    return None


def _start_decode(args: dict):
    from dtkv.demo._models import prompts, vocab_of
    from dtkv.demo._pd import start_decode_group

    return start_decode_group(args, prompts(args["tokens"], args["requests"], vocab_of(args), args["seed"]))


def main(argv: list[str] | None = None, *, prog: str = "python -m dtkv.demo") -> int:
    """Run the demo (see :mod:`dtkv.demo`); returns the exit code (0 parity, 1 mismatch, 2 usage error)."""
    args, error = parse(argv, _DESCRIPTION, prog)
    env = args.pop("torchrun")
    note = args.pop("model_note")
    first = env is None or env[0] == 0  # the process that prints (torchrun: rank 0)
    if error:
        return _usage_error(error, printing=first)
    setup_cli_logging(side="prefill" if args["pd"] and env is not None else None)  # torchrun: a prefill rank
    if note and first:
        logging.getLogger("dtkv.demo").warning("%s", note)
    import torch

    want = env[2] + 1 if env is not None else args["cp"]
    if args["device"] == "auto":
        args["device"] = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= want else "cpu"
    error = _device_error(args, want)
    if error:
        return _usage_error(error, printing=first)
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
    """Print the table or the JSON object of a finished run; the exit code (0 parity, 1 otherwise, 2 when the
    ranks stopped at a usage error).

    Every torchrun rank computes the verdict from the same gathered results (the same exit code everywhere); only
    rank 0, which hosts the decode group of ``--pd``, adds its verdict and prints.
    """
    from dtkv.demo._report import print_table, summary

    errors = [r for r in results if "error" in r]
    if errors:
        usage = [e for e in errors if e.get("usage")]
        if pd is not None:
            pd.result(timeout_s=5.0)
        if usage:  # every rank stopped at the same rule: one line, as a parse-time usage error
            return _usage_error(usage[0]["error"].splitlines()[0], printing=printing)
        if printing:
            for e in errors:
                print(f"rank {e['rank']} failed: {e['error']}", file=sys.stderr)
            if args["json"]:
                print(json.dumps({"parity": False, "cp": args["cp"], "error": errors[0]["error"].splitlines()[0]}))
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
