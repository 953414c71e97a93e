"""dtkv.integrations: run real model code on dtkv's sharded KV.

- :mod:`dtkv.integrations.transformers` -- Hugging Face transformers DSA models (``DeepseekV32ForCausalLM``,
  ``GlmMoeDsaForCausalLM``) with chunked CP prefill over page-ownership-sharded pools (optional extra ``hf``).

Subpackages import their framework on demand; importing this package needs nothing beyond dtkv.
"""

from __future__ import annotations

__all__: list[str] = []
