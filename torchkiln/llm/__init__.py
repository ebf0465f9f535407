"""LLM inference: ``tk.llm.optimize(hf_model)`` and a fast ``generate()`` (docs/llm.md).

spec.py reads the decoder's structure (no architecture-name list); model.py is the one fast
decoder over a static KV cache; runner.py compiles its decode step; generate.py and
sampling.py are transformers' generate semantics; api.py builds, verifies and reports.
"""

from .api import LLMReport, optimize
from .spec import DecoderSpec, Unsupported, read

__all__ = ["optimize", "LLMReport", "DecoderSpec", "Unsupported", "read"]
