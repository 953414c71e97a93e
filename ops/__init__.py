"""dtkv.ops: registered ``torch.library`` custom ops (namespace ``dtkv``) with torch and Triton kernels.

One op per module; each module holds the torch reference, the Triton kernel, the registration and the fake.
"""

from __future__ import annotations

__all__: list[str] = []
