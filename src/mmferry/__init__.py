"""mmferry: the multimodal input data path of LLM inference engines."""

from mmferry.errors import ArgumentError, ContractError, MediaError, MmferryError, WireError
from mmferry.fields import FieldSpec, Placement
from mmferry.items import Item, Items, split_items
from mmferry.transfer import Mirrored

__all__ = [
    "ArgumentError",
    "ContractError",
    "FieldSpec",
    "Item",
    "Items",
    "MediaError",
    "Mirrored",
    "MmferryError",
    "Placement",
    "WireError",
    "split_items",
]
__version__ = "0.1.0"
