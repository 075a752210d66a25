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

    ``is_mm_token`` is a host bool tensor (an engine builds it from the token ids it holds on
    the host). The placeholder positions are found on the host, where a count that differs
    from the rows is a :class:`ContractError`; the positions go up in one non-blocking copy
    and the rows are written with one ``index_put_``, with no temporaries of the embeddings'
    size. A device mask is refused: counting it would cost a sync, and a wrong count would
    become a device-side assert that kills the CUDA context.
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
    if is_mm_token.device.type != "cpu":
        raise ContractError(
            f"is_mm_token must be a host tensor, got one on {is_mm_token.device}: counting a "
            "device mask costs a sync, and a wrong count is a device-side assert")
    positions = is_mm_token.nonzero()  # [placeholders, mask dims], host work only
    if positions.shape[0] != rows.shape[0]:
        raise ContractError(
            f"{positions.shape[0]} placeholder tokens but {rows.shape[0]} multimodal embedding rows"
        )
    if rows.device != inputs_embeds.device:
        raise ContractError(f"multimodal embeddings on {rows.device}, inputs_embeds on "
                            f"{inputs_embeds.device}")
    index = upload(positions, inputs_embeds.device).unbind(1)
    return inputs_embeds.index_put_(index, rows.to(inputs_embeds.dtype))
