"""Deprecated (one release): sharded decode is the runtime's, for every model (:mod:`dtkv.runtime`,
``Runtime(decode_mode="sharded")``; a layer of :class:`dtkv.decode.DecodeStep`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dtkv._util import warn_deprecated

__all__ = ["plan_sharded_step", "sharded_decode_step"]


def plan_sharded_step(engine, reqs: Sequence):
    """Deprecated: the plan phase of a sharded decode step (allocates the next pages, returns a ``DecodePlan``)."""
    from dtkv.runtime._decode import plan_sharded_step as plan

    warn_deprecated("dtkv.model.sharded_decode.plan_sharded_step", "Runtime.decode_step (decode_mode='sharded')")
    return plan(engine, reqs)


def sharded_decode_step(engine, reqs: Sequence) -> torch.Tensor:
    """Deprecated: ``engine.decode_step(reqs)`` of a runtime with ``decode_mode="sharded"``."""
    warn_deprecated("dtkv.model.sharded_decode.sharded_decode_step", "Runtime.decode_step (decode_mode='sharded')")
    return engine.decode_step(reqs)
