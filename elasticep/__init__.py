"""ElasticEP: fault-tolerant, elastic expert-parallel inference for MoE language models.

``from elasticep import LLM, SamplingParams`` is the offline Python API (vLLM's shape,
:mod:`elasticep.entrypoints.llm`); both load lazily, so ``import elasticep`` stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "GrammarSpec", "RequestOutput", "CompletionOutput",
           "__version__"]

if TYPE_CHECKING:
    from elasticep.engine.request import GrammarSpec, SamplingParams
    from elasticep.entrypoints.llm import LLM, CompletionOutput, RequestOutput

_LAZY = {"LLM": "elasticep.entrypoints.llm", "RequestOutput": "elasticep.entrypoints.llm",
         "CompletionOutput": "elasticep.entrypoints.llm",
         "SamplingParams": "elasticep.engine.request",
         "GrammarSpec": "elasticep.engine.request"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'elasticep' has no attribute {name!r}")
