"""Encoder runtime: the model protocol, the encoder cache, the runner, scatter and merge."""

from mmferry.encoder.cache import CacheStats, EncoderCache, EncoderCacheError
from mmferry.encoder.merge import merge_embeddings, scatter_output_slices
from mmferry.encoder.model import EncoderModel
from mmferry.encoder.runner import EncoderRunner, RunStats

__all__ = [
    "CacheStats",
    "EncoderCache",
    "EncoderCacheError",
    "EncoderModel",
    "EncoderRunner",
    "RunStats",
    "merge_embeddings",
    "scatter_output_slices",
]
