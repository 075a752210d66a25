"""The `mmferry` command: encode, models, and the shared argument validation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image
from safetensors.torch import load_file

from mmferry.cli import main


@pytest.fixture
def images(tmp_path: Path) -> list[Path]:
    rng = np.random.default_rng(1)
    paths = []
    for i, (w, h) in enumerate([(64, 48), (56, 56)]):
        path = tmp_path / f"img{i}.png"
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
        paths.append(path)
    return paths


def run(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_encode_samples_prints_one_row_per_item() -> None:
    result = run("encode", "--samples", "3")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split()[:4] == ["file", "tokens", "embedding", "cache"]
    rows = [line.split() for line in lines[1:4]]
    assert [r[3] for r in rows] == ["miss", "miss", "repeat"]
    assert [r[4] for r in rows] == ["image", "video", "image"]  # qwen2-vl takes both
    assert rows[0][1] == rows[2][1] and rows[0][2] == rows[2][2]
    assert "2 encoder call(s)" in result.output


def test_encode_pixel_options_reach_the_processor(images: list[Path], tmp_path: Path) -> None:
    saved = {}
    for name, options in (("levels", []), ("floats", ["--pixel-dtype", "float32"]),
                          ("exact", ["--resize-mode", "exact"])):
        out = tmp_path / f"{name}.safetensors"
        result = run("encode", *map(str, images), *options, "--out", str(out))
        assert result.exit_code == 0, result.output
        saved[name] = load_file(out)
    # Keys are item hashes: the dtype changes every item; the resize mode changes the
    # 64x48 image (resized to 56x56) and not the 56x56 one (not resized).
    assert saved["levels"].keys().isdisjoint(saved["floats"])
    assert len(saved["exact"].keys() & saved["levels"].keys()) == 1
    # uint8 levels and float32 pixels are the same input to the encoder (files hold their
    # embeddings in key order, so each is matched to its nearest).
    for a in saved["levels"].values():
        assert min((a - b).abs().max() for b in saved["floats"].values() if b.shape == a.shape) < 1e-5


def test_encode_reports_bad_files_and_still_encodes_the_rest(images: list[Path], tmp_path: Path) -> None:
    truncated = tmp_path / "truncated.png"
    truncated.write_bytes(images[0].read_bytes()[:60])
    missing = tmp_path / "missing.png"
    out = tmp_path / "emb.safetensors"
    result = run("encode", str(images[0]), str(truncated), str(missing), str(images[1]),
                 "--out", str(out))
    assert result.exit_code == 1
    errors = result.stderr.splitlines()
    assert any("truncated.png" in e for e in errors) and any("missing.png" in e for e in errors)
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines()[1:5]}
    assert rows["img0.png"][3] == "miss" and rows["img1.png"][3] == "miss"
    assert rows["truncated.png"][3] == "error" and rows["missing.png"][3] == "error"
    saved = load_file(str(out))
    assert len(saved) == 2
    assert sorted(int(t.shape[0]) for t in saved.values()) == sorted(
        int(rows[n][1]) for n in ("img0.png", "img1.png")
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["encode", "--samples", "2", "--model", "nope"], "unknown model 'nope'"),
        (["encode", "--samples", "2", "--device", "xpu"], "--device"),
        (["encode", "--samples", "2", "--out", "emb.txt"], "--out"),
        (["encode", "--samples", "0"], "--samples"),
        (["encode", "--samples", "2", "--weights", "/nonexistent"], "--weights"),
        (["encode"], "give FILES"),
    ],
)
def test_bad_arguments_are_usage_errors(args: list[str], message: str) -> None:
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2
    assert message in result.output


def test_models_lists_fields_kinds_and_placements() -> None:
    result = run("models")
    assert result.exit_code == 0, result.output
    rows = {tuple(line.split()[:3]): line.split()[3:] for line in result.output.splitlines()[1:]}
    assert rows[("qwen2-vl", "image", "pixel_values")] == ["flat_from_sizes", "device"]
    assert rows[("qwen2-vl", "image", "image_grid_thw")] == ["batched", "host"]


def test_item_over_the_step_budget_fails_alone() -> None:
    # The sample image has 256 tokens, the sample video 280.
    result = run("encode", "--samples", "3", "--max-tokens-per-step", "260")
    assert result.exit_code == 1
    rows = [line.split() for line in result.stdout.splitlines()[1:4]]
    assert [r[3] for r in rows] == ["miss", "error", "repeat"]
    assert "280 tokens, more than max_tokens_per_step=260" in result.stderr


def test_encode_takes_video_files_frame_folders_and_refuses_other_modalities(
        tmp_path: Path) -> None:
    import av

    from mmferry.media import samples

    frames = samples.video_like(6, 64, 96, seed=3)
    mp4 = tmp_path / "clip.mp4"
    with av.open(str(mp4), "w") as container:
        stream = container.add_stream("libx264", rate=4)
        stream.width, stream.height, stream.pix_fmt = 96, 64, "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    folder = samples.write_video(tmp_path / "frames", frames)
    wav = samples.write_audio(tmp_path / "speech.wav", samples.speech_like(1.0), 16000)
    result = run("encode", str(mp4), str(folder), str(wav))
    assert result.exit_code == 1
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines()[1:4]}
    assert rows["clip.mp4"][3:6] == ["miss", "video", "6x96x64"]
    assert rows["frames"][3:6] == ["miss", "video", "6x96x64"]
    # Six frames pad to three temporal patches either way; lossy H.264 changes the pixels.
    assert rows["clip.mp4"][1] == rows["frames"][1] != "-"
    assert rows["speech.wav"][3] == "error"
    assert "speech.wav: is audio; qwen2-vl takes image, video" in result.stderr


def test_directories_fifos_and_non_images_are_per_file_errors(images: list[Path],
                                                              tmp_path: Path) -> None:
    import os

    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs on this platform")
    folder = tmp_path / "a-folder"
    folder.mkdir()
    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)
    text = tmp_path / "notes.png"
    text.write_text("not an image")
    result = CliRunner().invoke(main, ["encode", str(folder), str(images[0]), str(fifo),
                                       str(text), str(images[1])])
    assert result.exit_code == 1
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines()[1:6]}
    assert rows["img0.png"][3] == "miss" and rows["img1.png"][3] == "miss"
    for name, why in (("a-folder", "holds no files"), ("pipe.png", "not a regular file"),
                      ("notes.png", "cannot identify")):
        assert rows[name][3] == "error"
        assert any(name in e and why in e for e in result.stderr.splitlines()), result.stderr
    assert "Traceback" not in result.output


def _checkpoint(tmp_path: Path, vision: dict) -> Path:
    import json

    folder = tmp_path / "ckpt"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(
        {"model_type": "qwen2_vl", "vision_config": vision}))
    return folder


@pytest.mark.parametrize(("vision", "key"), [
    ({"depth": "two"}, "vision_config.depth"),
    ({"embed_dim": 0}, "vision_config.embed_dim"),
    ({"num_heads": 0}, "vision_config.num_heads"),
    ({"rope_theta": "ten thousand"}, "vision_config.rope_theta"),
    ({"patch_size": 14.5}, "vision_config.patch_size"),
    ({"mlp_ratio": None}, "vision_config.mlp_ratio"),
    ({"hidden_act": 3}, "vision_config.hidden_act"),
    ({"depth": True}, "vision_config.depth"),
])
def test_bad_config_values_are_one_line_usage_errors(tmp_path: Path, vision: dict,
                                                     key: str) -> None:
    folder = _checkpoint(tmp_path, {"depth": 1, "embed_dim": 32, "num_heads": 2,
                                    "hidden_size": 64, **vision})
    result = CliRunner().invoke(main, ["encode", "--samples", "1", "--weights", str(folder)])
    assert result.exit_code == 2, result.output
    assert key in result.output and "Traceback" not in result.output
    assert isinstance(result.exception, SystemExit)


@pytest.mark.parametrize("problem", ["bad json", "no weights", "json list"])
def test_bad_weights_folders_are_usage_errors(tmp_path: Path, problem: str) -> None:
    folder = _checkpoint(tmp_path, {"depth": 1, "embed_dim": 32, "num_heads": 2,
                                    "hidden_size": 64})
    if problem == "bad json":
        (folder / "config.json").write_text("{not json")
    elif problem == "json list":
        (folder / "config.json").write_text("[1, 2]")
    result = CliRunner().invoke(main, ["encode", "--samples", "1", "--weights", str(folder)])
    assert result.exit_code == 2, result.output
    assert "--weights" in result.output and "Traceback" not in result.output


def test_an_unwritable_out_is_caught_before_encoding(images: list[Path], tmp_path: Path,
                                                     monkeypatch) -> None:
    import mmferry.encoder.runner as runner_module

    calls = []
    monkeypatch.setattr(runner_module.EncoderRunner, "encode",
                        lambda self, *a, **k: calls.append(1))
    taken = tmp_path / "emb.safetensors"
    taken.mkdir()
    result = CliRunner().invoke(main, ["encode", str(images[0]), "--out", str(taken)])
    assert result.exit_code == 2 and "--out" in result.output and "directory" in result.output
    assert not calls


def test_encode_audio_files_prints_seconds_and_fails_bad_ones_alone(tmp_path: Path) -> None:
    from mmferry.media import samples

    good = samples.write_audio(tmp_path / "speech.wav", samples.speech_like(2.5, 16000), 16000)
    empty = tmp_path / "empty.wav"
    empty.write_bytes(b"")
    image = tmp_path / "pic.png"
    Image.fromarray(samples.photo_like(32, 32)).save(image)
    result = run("encode", "--model", "qwen2-audio", str(good), str(empty), str(image))
    assert result.exit_code == 1
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines()[1:4]}
    assert rows["speech.wav"][3:6] == ["miss", "audio", "2.50s"]
    # Whisper: 250 mel frames -> (250 - 1) // 2 + 1 = 125 after the stride-2 conv ->
    # (125 - 2) // 2 + 1 = 62 after pooling.
    assert rows["speech.wav"][1] == "62"
    assert rows["empty.wav"][3] == "error" and rows["pic.png"][3] == "error"
    assert "empty.wav" in result.stderr and "pic.png: is image" in result.stderr
