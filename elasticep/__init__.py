"""ElasticEP: fault-tolerant, elastic expert-parallel inference for MoE language models."""

__version__ = "0.1.0"
