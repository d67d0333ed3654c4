"""Qwen2-family transformer runtime: config, KV cache, checkpoint loading, tokenizer."""

from failfast.model.checkpoint import LoadedModel, ModelDescription, describe_model, load_model
from failfast.model.config import ModelConfig
from failfast.model.kv_cache import KVCache
from failfast.model.tokenizer import Tokenizer
from failfast.model.transformer import Transformer

__all__ = [
    "KVCache",
    "LoadedModel",
    "ModelConfig",
    "ModelDescription",
    "Tokenizer",
    "Transformer",
    "describe_model",
    "load_model",
]
