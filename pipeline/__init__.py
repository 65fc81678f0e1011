"""batchgen: offline bulk batch inference for LLMs."""
from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["Engine", "EngineSpec", "GenerationRequest", "GenerationResult", "ModelSpec", "SamplingParams",
           "__version__"]


def __getattr__(name):
    # The CLI's --help and the torch-free engine core should not pay for importing torch.
    if name in ("Engine", "GenerationRequest", "GenerationResult"):
        from . import llm

        return getattr(llm, name)
    if name in ("EngineSpec", "ModelSpec"):
        from . import config

        return getattr(config, name)
    if name == "SamplingParams":
        from .engine.request import SamplingParams

        return SamplingParams
    raise AttributeError(name)
