"""The interface every encoder model implements (a structural protocol, no base class)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from mmferry.fields import FieldSpec

__all__ = ["EncoderModel"]


@runtime_checkable
class EncoderModel(Protocol):
    """A multimodal encoder as the runtime drives it.

    ``processor`` turns media into processor output on the host; ``field_specs`` gives the
    contract for exactly the fields that output holds; ``tokens_per_item`` counts an item's
    output rows from host fields alone, before the encoder runs; ``encode`` takes one batch
    (each field where its placement says) and returns ``[sum of the batch's tokens, hidden]``.

    A model may also declare ``precomputed_fields``: names of fields that already hold encoder
    output (vLLM's ``image_embeds``); the runner takes a batch carrying one as its output and
    does not call ``encode``.
    """

    name: str
    modalities: tuple[str, ...]
    hidden_size: int

    def processor(self, *, images: Any = None, videos: Any = None, audios: Any = None,
                  **kwargs: Any) -> Mapping[str, Any]: ...

    def field_specs(self, outputs: Mapping[str, Any]) -> Mapping[str, FieldSpec]: ...

    def tokens_per_item(self, item: Mapping[str, Any]) -> int: ...

    def encode(self, **batch: Any) -> torch.Tensor: ...

    def dummy_inputs(self) -> Mapping[str, Any]: ...
