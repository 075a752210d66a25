"""uint8 pixels: the normalisation in the contract, the two resize modes, the folded first layer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import mmferry as mf
from mmferry.media.resize import check_pixel_options, resize
from mmferry.media.samples import photo_like
from mmferry.models.blocks import PixelFold, check_normalize

CLIP = mf.Normalize((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))
HALF = mf.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))


def _items(normalize: mf.Normalize | None, pixels: torch.Tensor) -> mf.Items:
    specs = {"pixel_values": mf.FieldSpec.flat_from_sizes("image", [4, 6], normalize=normalize),
             "grid": mf.FieldSpec.batched("image", placement="host")}
    return mf.split_items({"pixel_values": pixels, "grid": torch.tensor([[1, 2, 2], [1, 2, 3]])},
                          specs)


LEVELS = torch.arange(120, dtype=torch.uint8).view(10, 12)


def test_normalize_travels_with_the_item_through_wire_and_batch() -> None:
    items = _items(CLIP, LEVELS)
    assert items["image"][0].specs["pixel_values"].normalize == CLIP
    back = mf.wire.decode(mf.wire.encode(items))
    assert back == items
    assert [i.hash for i in back.in_order()] == [i.hash for i in items.in_order()]
    (batch,) = mf.batch_items(back)
    assert batch.specs["pixel_values"].normalize == CLIP
    moved = mf.Transfer("cpu").to_device(batch)
    assert moved["pixel_values"].dtype == torch.uint8
    assert torch.equal(moved["pixel_values"], LEVELS)


def test_normalize_is_part_of_the_hash_and_keeps_batches_apart() -> None:
    a, b = _items(CLIP, LEVELS), _items(HALF, LEVELS)
    assert a["image"][0].hash != b["image"][0].hash
    assert len(mf.batch_items([a["image"][0], b["image"][0]])) == 2
    assert len(mf.batch_items([a["image"][0], a["image"][1]])) == 1


def test_spec_dict_round_trip_and_bad_normalize() -> None:
    spec = mf.FieldSpec.flat_from_sizes("image", [3], normalize=HALF)
    assert mf.FieldSpec.from_dict(spec.to_dict()) == spec
    assert hash(mf.FieldSpec.from_dict(spec.to_dict())) == hash(spec)
    with pytest.raises(mf.ContractError, match="std must not hold 0"):
        mf.Normalize((0.5,), (0.0,))
    with pytest.raises(mf.ContractError, match="same 1 to"):
        mf.Normalize((0.5, 0.5), (0.5,))
    with pytest.raises(mf.ContractError, match="finite"):
        mf.Normalize((float("nan"),), (1.0,))
    with pytest.raises(mf.ContractError, match="mapping of mean"):
        mf.FieldSpec.from_dict({**spec.to_dict(), "normalize": {"mean": [0.5], "bias": 1}})


def test_a_normalized_field_holds_uint8_only() -> None:
    with pytest.raises(mf.ContractError, match=r"pixel_values.*uint8"):
        _items(CLIP, LEVELS.float())


def test_wire_refuses_a_malformed_normalize() -> None:
    frames = mf.wire.encode(_items(CLIP, LEVELS))
    header = bytes(frames[0])
    bad = header.replace(b"std", b"sdt")  # an unknown key in the normalize mapping
    assert bad != header
    with pytest.raises(mf.WireError, match="normalize"):
        mf.wire.decode([bad, *frames[1:]])


def test_pixel_options_are_checked() -> None:
    check_pixel_options("uint8", "fast")
    check_pixel_options("float32", "exact")
    with pytest.raises(mf.ArgumentError, match="pixel_dtype"):
        check_pixel_options("float16", "fast")
    with pytest.raises(mf.ArgumentError, match="resize_mode"):
        check_pixel_options("uint8", "nearest")


@pytest.mark.parametrize(("source", "target"), [((300, 200), (448, 308)), ((768, 1024), (756, 1008)),
                                                ((97, 131), (56, 84))])
def test_resize_modes(source: tuple[int, int], target: tuple[int, int]) -> None:
    image = Image.fromarray(photo_like(*source))
    exact = resize(image, *target, mode="exact")
    np.testing.assert_array_equal(exact, np.asarray(image.resize(target[::-1], Image.Resampling.BICUBIC)))
    fast = resize(image, *target, mode="fast")
    chw = torch.from_numpy(np.array(image)).permute(2, 0, 1).contiguous()[None]
    expected = F.interpolate(chw, size=target, mode="bicubic", antialias=True)[0].permute(1, 2, 0)
    np.testing.assert_array_equal(fast, expected.numpy())
    np.testing.assert_array_equal(resize(image, *target, mode="fast", contiguous=False), fast)
    assert fast.shape == exact.shape == (*target, 3) and fast.dtype == np.uint8
    # The two filters differ by rounding, not by content.
    assert np.abs(fast.astype(int) - exact.astype(int)).max() <= 3
    same = resize(image, *source, mode="fast")
    np.testing.assert_array_equal(same, np.asarray(image))
    # A view of channel planes, the same pixels.
    for mode, hwc in (("exact", exact), ("fast", fast)):
        planes = resize(image, *target, mode=mode, contiguous=False)
        np.testing.assert_array_equal(planes, hwc)
        assert planes.transpose(2, 0, 1).flags.c_contiguous
    assert fast.flags.c_contiguous and exact.flags.c_contiguous


def test_fold_equals_normalising_first() -> None:
    torch.manual_seed(0)
    weight, bias = torch.randn(16, 3, 2, 4, 4) * 0.05, torch.randn(16)
    levels = torch.randint(0, 256, (9, 3 * 2 * 4 * 4), dtype=torch.uint8)
    a, c = CLIP.affine()
    normalised = (levels.view(9, 3, -1).double() * a[:, None] + c[:, None]).float().view(9, -1)
    expected = F.linear(normalised, weight.view(16, -1), bias)
    fold = PixelFold()
    w, b = fold(weight, bias, CLIP, 1)
    got = F.linear(levels.float(), w.view(16, -1), b)
    assert (got - expected).abs().max() < 1e-5
    assert fold(weight, bias, CLIP, 1)[0] is w  # kept while the weight is unchanged
    with torch.no_grad():
        weight.mul_(2)
    w2, _ = fold(weight, bias, CLIP, 1)
    assert w2 is not w and torch.allclose(w2, 2 * w)
    with pytest.raises(mf.ContractError, match="input channels"):
        fold(weight, bias, mf.Normalize((0.5,), (0.5,)), 1)


def test_check_normalize_names_the_field() -> None:
    check_normalize(_items(CLIP, LEVELS)["image"][0], "pixel_values", CLIP)
    # Another normalisation, none in the spec, and a plain mapping (no specs at all).
    for wrong in (_items(HALF, LEVELS)["image"][0], _items(None, LEVELS)["image"][0],
                  dict(_items(CLIP, LEVELS)["image"][0])):
        with pytest.raises(mf.ContractError, match="pixel_values"):
            check_normalize(wrong, "pixel_values", CLIP)


def test_fold_sums_a_repeated_input_away() -> None:
    torch.manual_seed(1)
    weight = torch.randn(8, 3, 2, 4, 4) * 0.05
    image = torch.randint(0, 256, (5, 3, 1, 4, 4), dtype=torch.uint8)
    a, c = HALF.affine()
    repeated = image.expand(5, 3, 2, 4, 4).double() * a.view(1, 3, 1, 1, 1) + c.view(1, 3, 1, 1, 1)
    expected = F.linear(repeated.float().reshape(5, -1), weight.view(8, -1))
    w, b = PixelFold()(weight, None, HALF, 1, sum_dims=(2,))
    assert w.shape == (8, 3, 4, 4)
    got = F.linear(image.reshape(5, -1).float(), w.view(8, -1), b)
    assert (got - expected).abs().max() < 1e-5


def test_fold_of_weights_made_under_inference_mode() -> None:
    with torch.inference_mode():
        weight = torch.randn(4, 3, 2, 2)
    levels = torch.randint(0, 256, (2, 12), dtype=torch.uint8)
    w, b = PixelFold()(weight, None, HALF, 1)
    a, c = HALF.affine()
    normalised = (levels.view(2, 3, -1).double() * a[:, None] + c[:, None]).float().view(2, -1)
    with torch.inference_mode():
        got, want = F.linear(levels.float(), w.view(4, -1), b), F.linear(normalised, weight.view(4, -1))
    assert (got - want).abs().max() < 1e-5
