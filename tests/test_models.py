"""The model registry and checkpoint loading (tiny checkpoints written by transformers)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import mmferry.models as models
from mmferry.encoder.model import EncoderModel
from mmferry.errors import ArgumentError
from mmferry.models import CheckpointError

VISION = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, patch_size=14,
              temporal_patch_size=2, spatial_merge_size=2)
TEXT = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, bos_token_id=0, eos_token_id=1,
            rope_parameters={"rope_type": "default", "mrope_section": [4, 4, 8],
                             "rope_theta": 10000.0})


def test_names_and_unknown_name() -> None:
    assert "qwen2-vl" in models.names()
    with pytest.raises(ArgumentError, match="available: qwen2-vl") as e:
        models.load("qwen3-omni")
    assert e.value.argument == "model"


def test_tiny_is_deterministic_and_an_encoder_model() -> None:
    a, b = models.load("qwen2-vl"), models.load("qwen2-vl")
    assert isinstance(a, EncoderModel)
    assert (a.name, a.modalities, a.hidden_size) == ("qwen2-vl", ("image", "video"), 64)
    assert not a.training and not any(p.requires_grad for p in a.parameters())
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert sa["visual.blocks.0.attn.qkv.weight"].std() > 0.01  # really random, not zeros
    d = {k: v for k, v in a.dummy_inputs().items() if k in ("pixel_values", "image_grid_thw")}
    assert torch.equal(a.encode(**d), b.encode(**d))


def test_config_dict_builds_that_size_and_reads_only_the_vision_part() -> None:
    # The shape of a real config.json (Qwen2-VL-2B spells some keys the old way), shrunk.
    config = {
        "model_type": "qwen2_vl", "hidden_size": 1536, "vocab_size": 151936,
        "vision_config": {"depth": 1, "embed_dim": 64, "mlp_ratio": 4, "num_heads": 4,
                          "in_chans": 3, "hidden_size": 96, "patch_size": 14,
                          "spatial_merge_size": 2, "spatial_patch_size": 14,
                          "temporal_patch_size": 2},
    }
    model = models.load("qwen2-vl", config=config)
    assert model.hidden_size == 96 and len(model.visual.blocks) == 1
    assert model.state_dict()["visual.blocks.0.mlp.fc1.weight"].shape == (256, 64)
    assert model.config.rope_theta == 10000.0
    themed = models.load("qwen2-vl", config={"vision_config": {
        **config["vision_config"], "rope_parameters": {"rope_type": "axial", "rope_theta": 777.0}}})
    assert themed.config.rope_theta == 777.0
    with pytest.raises(ArgumentError, match="qwen2_5_vl"):
        models.load("qwen2-vl", config={**config, "model_type": "qwen2_5_vl"})
    with pytest.raises(ArgumentError, match="heads"):
        models.load("qwen2-vl", config={"vision_config": {**VISION, "embed_dim": 30}})
    with pytest.raises(ArgumentError, match="config"):
        models.load("qwen2-vl", config="huge")
    with pytest.raises(ArgumentError, match="dtype"):
        models.load("qwen2-vl", dtype="int8")


# -- checkpoints written by transformers -------------------------------------------------

@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory):
    """A tiny Qwen2VLForConditionalGeneration saved with save_pretrained, its vision tower
    for reference outputs, and the folder."""
    import transformers
    Qwen2VLConfig, Qwen2VLForConditionalGeneration = (
        transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration)

    torch.manual_seed(0)
    hf = Qwen2VLForConditionalGeneration(
        Qwen2VLConfig(vision_config=VISION, text_config=TEXT)).eval()
    with torch.no_grad():  # biases and norms too, so a wrongly loaded one would show
        for p in hf.model.visual.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    folder = tmp_path_factory.mktemp("qwen2vl")
    hf.save_pretrained(folder)
    return hf.model.visual, folder


def _outputs(model, visual) -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(0)
    out = model.processor(images=[rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
                                  for h, w in ((56, 84), (100, 60))],
                          min_pixels=28 * 28, max_pixels=28 * 28 * 64, pixel_dtype="float32")
    with torch.no_grad():
        want = visual(out["pixel_values"], grid_thw=out["image_grid_thw"]).pooler_output
        return model.encode(**out), want


def _copy(folder: Path, dest: Path, state: dict[str, torch.Tensor]) -> Path:
    dest.mkdir()
    shutil.copy(folder / "config.json", dest / "config.json")
    save_file(state, dest / "model.safetensors")
    return dest


def test_save_pretrained_checkpoint_loads_by_name_and_matches(saved) -> None:
    visual, folder = saved
    keys = load_file(folder / "model.safetensors").keys()
    assert "visual.patch_embed.proj.weight" in keys  # the public layout, as 5.24 saves it
    model = models.load("qwen2-vl", weights=folder)
    got, want = _outputs(model, visual)
    # Same float32 arithmetic as the parity tests (see tests/test_qwen2_vl.py for the bound).
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    with pytest.raises(ArgumentError, match="not both"):
        models.load("qwen2-vl", weights=folder, config={"vision_config": VISION})


def test_sharded_checkpoint_with_the_newer_prefix(saved, tmp_path: Path) -> None:
    visual, folder = saved
    state = load_file(folder / "model.safetensors")
    # Newer transformers save the vision tower as `model.visual.`; shard it over two files.
    renamed = {("model." + k if k.startswith("visual.") else k): v for k, v in state.items()}
    names = sorted(renamed)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    dest = tmp_path / "sharded"
    dest.mkdir()
    shutil.copy(folder / "config.json", dest / "config.json")
    weight_map = {}
    for file, keys in halves.items():
        save_file({k: renamed[k].contiguous() for k in keys}, dest / file)
        weight_map.update(dict.fromkeys(keys, file))
    (dest / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    # The real file's keys (Qwen2-VL-7B-Instruct's max_pixels is far above the class default).
    (dest / "preprocessor_config.json").write_text(json.dumps(
        {"min_pixels": 3136, "max_pixels": 12845056, "image_std": [0.5, 0.5, 0.5]}))
    model = models.load("qwen2-vl", weights=dest)
    assert model.processor_config.max_pixels == 12845056
    assert model.processor_config.image_std == (0.5, 0.5, 0.5)
    got, want = _outputs(model, visual)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    got16 = models.load("qwen2-vl", weights=dest, dtype=torch.bfloat16)
    assert got16.visual.merger.mlp[2].weight.dtype == torch.bfloat16


def _drop_qkv(state: dict[str, torch.Tensor]) -> None:
    del state["visual.blocks.1.attn.qkv.weight"]


def _misshape_merger(state: dict[str, torch.Tensor]) -> None:
    state["visual.merger.mlp.0.weight"] = torch.zeros(3, 4)


@pytest.mark.parametrize(("break_it", "match", "parameter"), [
    (_drop_qkv, r"missing 'visual\.blocks\.1\.attn\.qkv\.weight'", "visual.blocks.1.attn.qkv.weight"),
    (_misshape_merger, r"shape \[3, 4\].*visual\.merger\.mlp\.0\.weight",
     "visual.merger.mlp.0.weight"),
], ids=["missing", "misshaped"])
def test_bad_weight_names_the_parameter(saved, tmp_path: Path, break_it, match: str,
                                        parameter: str) -> None:
    _, folder = saved
    state = load_file(folder / "model.safetensors")
    break_it(state)
    with pytest.raises(CheckpointError, match=match) as e:
        models.load("qwen2-vl", weights=_copy(folder, tmp_path / "ckpt", state))
    assert e.value.parameter == parameter


def test_unexpected_vision_weight_is_reported(saved, tmp_path: Path) -> None:
    _, folder = saved
    state = load_file(folder / "model.safetensors")
    state["visual.blocks.2.norm1.weight"] = torch.ones(32)  # a third block the config lacks
    with pytest.raises(CheckpointError, match=r"unexpected 'visual\.blocks\.2\.norm1\.weight'"):
        models.load("qwen2-vl", weights=_copy(folder, tmp_path / "u", state))


def test_unreadable_folders(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"config\.json"):
        models.load("qwen2-vl", weights=tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"vision_config": VISION}))
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        models.load("qwen2-vl", weights=tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(CheckpointError, match="cannot open"):
        models.load("qwen2-vl", weights=tmp_path)
