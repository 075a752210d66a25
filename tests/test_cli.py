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
    assert "280 tokens, more than the step budget of 260" in result.stderr


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
