"""The interface every encoder model implements (a structural protocol, no base class)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from mmferry.fields import FieldSpec

__all__ = ["EncoderModel", "ModelClass"]


@runtime_checkable
class EncoderModel(Protocol):
    """A multimodal encoder as the runtime, the CLI, the audit and the servers drive it.

    ``processor`` turns media into processor output on the host; ``field_specs`` gives the
    contract for exactly the fields that output holds; ``check_item`` vets one item against
    its own metadata; ``tokens_per_item`` counts an item's
    output rows from host fields alone, before the encoder runs; ``encode`` takes one batch
    (each field where its placement says) and returns ``[sum of the batch's tokens, hidden]``;
    ``dummy_inputs`` is processor output that exercises every branch of ``encode`` (several
    items of different sizes, and each modality the model takes).

    ``precomputed_fields`` names fields that already hold encoder output (vLLM's
    ``image_embeds``): the runner takes a batch carrying one as its output and does not call
    ``encode``. ``checkpoint_prefixes`` maps a checkpoint key prefix to the model's own
    parameter-name prefix, or to ``None`` for keys to skip (tensors the model recomputes);
    keys under no prefix (the language model's) are never read.
    """

    name: str
    modalities: tuple[str, ...]
    hidden_size: int
    precomputed_fields: frozenset[str]
    checkpoint_prefixes: Mapping[str, str | None]

    def processor(self, *, images: Any = None, videos: Any = None, audios: Any = None,
                  **kwargs: Any) -> Mapping[str, Any]: ...

    def field_specs(self, outputs: Mapping[str, Any]) -> Mapping[str, FieldSpec]: ...

    def check_item(self, item: Mapping[str, Any]) -> None:
        """Raise :class:`~mmferry.errors.ContractError` naming the field when one item does not
        hold what the encoder would compute from it: tensors whose rows disagree with the
        item's own metadata (grid, sizes, lengths), or dims / dtypes the encoder does not take.
        Host work only. The runner calls it on every item before batching it with others, so a
        malformed item fails alone and never shifts a neighbour's rows."""
        ...

    def tokens_per_item(self, item: Mapping[str, Any]) -> int: ...

    def encode(self, **batch: Any) -> torch.Tensor: ...

    def dummy_inputs(self) -> Mapping[str, Any]: ...


class ModelClass(Protocol):
    """What :func:`mmferry.models.load` needs of a model's class: its name and how to build
    it (on whatever device is current; ``load`` builds on ``meta`` and then fills weights)."""

    name: str
    checkpoint_prefixes: Mapping[str, str | None]

    def from_config(self, config: Mapping[str, Any] | None,
                    folder: Path | None = None) -> EncoderModel:
        """``config``: ``None`` for the tiny architecture, else a checkpoint's ``config.json``
        content. ``folder``: the checkpoint folder, whose processor files
        (``preprocessor_config.json`` and the like) set the processor; ``None``: defaults.

        Raises :class:`~mmferry.errors.ArgumentError` naming the config key on bad values."""
        ...
