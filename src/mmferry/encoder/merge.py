"""Encoder output to language-model input: per-item scatter and the placeholder merge."""

from __future__ import annotations

from collections.abc import MutableMapping, MutableSequence, Sequence
from typing import Any

import torch

from mmferry.errors import ContractError
from mmferry.transfer import upload

__all__ = ["merge_embeddings", "scatter_output_slices"]


def scatter_output_slices(
    output: torch.Tensor,
    indices: Sequence[Any],
    per_item_out_tokens: Sequence[int],
    dest: MutableMapping[Any, torch.Tensor] | MutableSequence[Any],
    clone: bool = False,
) -> None:
    """Cut a batch's concatenated output into per-item rows: ``dest[indices[i]]`` gets the
    next ``per_item_out_tokens[i]`` rows (a view, or a copy with ``clone=True`` when the
    output buffer will be overwritten, e.g. by a CUDA graph replay).

    Token counts are host integers, so the cut needs no device-to-host sync.
    """
    if len(indices) != len(per_item_out_tokens):
        raise ContractError(
            f"{len(indices)} indices but {len(per_item_out_tokens)} token counts"
        )
    total = sum(per_item_out_tokens)
    if output.shape[0] != total:
        raise ContractError(f"output has {output.shape[0]} rows but the items need {total}")
    offset = 0
    for index, n in zip(indices, per_item_out_tokens, strict=True):
        rows = output[offset:offset + n]
        dest[index] = rows.clone() if clone else rows
        offset += n


def merge_embeddings(
    inputs_embeds: torch.Tensor,
    is_mm_token: torch.Tensor,
    mm_embeds: torch.Tensor | Sequence[torch.Tensor],
) -> torch.Tensor:
    """Write ``mm_embeds`` (rows in placeholder order) into ``inputs_embeds`` where
    ``is_mm_token`` is true, in place, and return ``inputs_embeds``.

    With a host mask the placeholder count is checked on the host (free) and a mismatch is a
    :class:`ContractError`; the mask is then uploaded without blocking. A device mask is used
    as it is: counting it would cost a sync, so only the row count is checked.
    """
    rows = mm_embeds if isinstance(mm_embeds, torch.Tensor) else (
        torch.cat(list(mm_embeds)) if len(mm_embeds) else inputs_embeds.new_empty(
            (0, inputs_embeds.shape[-1]))
    )
    if rows.ndim != 2 or rows.shape[-1] != inputs_embeds.shape[-1]:
        raise ContractError(
            f"multimodal embeddings of shape {tuple(rows.shape)} do not fit hidden size "
            f"{inputs_embeds.shape[-1]}"
        )
    if is_mm_token.shape != inputs_embeds.shape[:-1]:
        raise ContractError(
            f"is_mm_token has shape {tuple(is_mm_token.shape)}, "
            f"inputs_embeds {tuple(inputs_embeds.shape)}"
        )
    if is_mm_token.dtype != torch.bool:
        raise ContractError(f"is_mm_token must be bool, got {is_mm_token.dtype}")
    if is_mm_token.device.type == "cpu":
        expected = int(is_mm_token.sum())
        if expected != rows.shape[0]:
            raise ContractError(
                f"{expected} placeholder tokens but {rows.shape[0]} multimodal embedding rows"
            )
        is_mm_token = upload(is_mm_token, inputs_embeds.device)
    elif rows.shape[0] > is_mm_token.numel():
        raise ContractError(
            f"{rows.shape[0]} multimodal embedding rows for {is_mm_token.numel()} tokens"
        )
    mask = is_mm_token.unsqueeze(-1).expand_as(inputs_embeds)
    return inputs_embeds.masked_scatter_(mask, rows.to(inputs_embeds.dtype))
