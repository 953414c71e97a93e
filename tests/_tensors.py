"""What a block of torch code allocates: :class:`NewTensors` records the element count of every new tensor."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["NewTensors"]


class NewTensors(TorchFunctionMode):
    """Records the element count of every new tensor (not a view) a torch function returns inside the block
    (``numels``), so a test can bound the largest temporary a computation builds."""

    def __init__(self) -> None:
        super().__init__()
        self.numels: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple) else (out,):
            if isinstance(t, torch.Tensor) and t._base is None:
                self.numels.append(t.numel())
        return out
