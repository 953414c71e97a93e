"""``python -m dtkv.demo``: chunked CP prefill and decode of a DSA model on sharded KV, every phase checked.

One entry point for every model and every mode (each flag works with each model):

=================================  ==================================================================================
``--model``                        ``reference`` (the float64 reference model, default), ``deepseek-v32`` / ``glm5``
                                   (tiny random transformers models, no download), or a checkpoint directory
                                   (:func:`dtkv.integrations.transformers.load_model`)
``--cp N``                         the prefill group's ranks (gloo on CPU; NCCL when N GPUs are visible); under
                                   ``torchrun --nproc-per-node N -m dtkv.demo`` one job on torchrun's group
``--decode full|sharded``          decode over a materialized full view, or straight on the shards (no view)
``--multi-turn``                   a conversation and requests sharing its system prompt, with and without the prefix
                                   cache (transformers models run batch-invariant products for bitwise parity)
``--pd [--decode-cp M]``           hand every request to a decode group of M ranks (default 1) over Mooncake, or NIXL
                                   with ``--transfer-engine nixl``: each position written once into its decode
                                   owner's page, then decoded (``--decode``)
``--attention``                    the attention backend
=================================  ==================================================================================

What is checked (one JSON object with ``--json``: ``parity`` and ``checks``, each check with its rule, its worst case
and why; :mod:`dtkv.demo._verdict`): the reference model against the replicated-KV baseline (bitwise; sharded
decode within 1e-9 relative), a transformers model against its own forward (``stable_topk``, keys in the pools'
formats, tolerances by model and KV dtype), the prefix cache against the run without it (bitwise), PD against the
prefill group (KV bytes on the decode owners, greedy tokens). Each check's printed rule is the rule its verdict
applies (exceptions such as a bfloat16 model's near-tie flips are stated, with the margins); a transformers
model's worst difference is explained by the same prompts served in one process (cp=1). Progress lines go to
stderr (:mod:`dtkv._log`; quiet with ``DTKV_LOGLEVEL=WARNING``); stdout holds only the table or the JSON. Exit code
1 on any mismatch, 2 on a usage error: one ``error:`` line, never a traceback per rank (flags out of range, a
directory that is not a DSA checkpoint, a device or attention backend this machine cannot run).

``capacity_multiplier`` is replicated KV bytes per rank over sharded KV bytes per rank (pool only);
``capacity_multiplier_with_scratch`` also charges the materialization scratch of this run's largest batch, which at
demo sizes is as large as the pool itself; the table says so in its ``toy size`` line (``dtkv capacity --context``
sizes a real deployment).

Modules (no import circle: each imports only modules listed before it): :mod:`dtkv.demo._args` (flags and their
rules), :mod:`dtkv.demo._models` (models and prompts), :mod:`dtkv.demo.workloads` (the multi-turn workload),
:mod:`dtkv.demo._verdict` (parity rules), :mod:`dtkv.demo._pd` (the decode group), :mod:`dtkv.demo._run` (one rank),
:mod:`dtkv.demo._launch` (the groups), :mod:`dtkv.demo._report` (JSON and table), :mod:`dtkv.demo._cli` (``main``).
"""

from __future__ import annotations

__all__ = ["main"]


def main(argv: list[str] | None = None, *, prog: str = "python -m dtkv.demo") -> int:
    """Run the demo with ``argv`` (default ``sys.argv[1:]``); returns the exit code (``prog`` names the command in
    ``--help`` and usage errors: ``dtkv demo`` under the ``dtkv`` command)."""
    from dtkv.demo._cli import main as _main

    return _main(argv, prog=prog)
