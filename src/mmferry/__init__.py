"""mmferry: the multimodal input data path of LLM inference engines.

The public API, in data-flow order: the field contract (:class:`FieldSpec`,
:class:`Placement`), the per-item split (:func:`split_items`), the wire format
(:mod:`mmferry.wire`), batching (:func:`batch_items`), the one-copy transfer
(:class:`Transfer`), the encoder runtime (:class:`EncoderRunner`, :class:`EncoderCache`,
:func:`scatter_output_slices`, :func:`merge_embeddings`) and the placement auditor
(:mod:`mmferry.audit`).
"""

from mmferry import audit, models, wire
from mmferry.batching import Batch, batch_items
from mmferry.encoder import (
    EncoderCache,
    EncoderCacheError,
    EncoderModel,
    EncoderRunner,
    merge_embeddings,
    scatter_output_slices,
)
from mmferry.errors import ArgumentError, ContractError, MediaError, MmferryError, WireError
from mmferry.fields import FieldSpec, Normalize, Placement
from mmferry.hashing import hash_media
from mmferry.items import Item, Items, split_items
from mmferry.transfer import DeviceBatch, Mirrored, Transfer, host_and_device

__all__ = [
    "ArgumentError",
    "Batch",
    "ContractError",
    "DeviceBatch",
    "EncoderCache",
    "EncoderCacheError",
    "EncoderModel",
    "EncoderRunner",
    "FieldSpec",
    "Item",
    "Items",
    "MediaError",
    "Mirrored",
    "MmferryError",
    "Normalize",
    "Placement",
    "Transfer",
    "WireError",
    "audit",
    "batch_items",
    "hash_media",
    "host_and_device",
    "merge_embeddings",
    "models",
    "scatter_output_slices",
    "split_items",
    "wire",
]
__version__ = "0.1.0"
