"""One validation path: every check runs for every subcommand that takes its option.

The bug class this guards against (vLLM #52825): a validator that picks its checks by the
subcommand's name, so a new subcommand silently skips them. Here the subcommands are
discovered from the CLI itself, so one added later is covered without editing this file.
"""

from __future__ import annotations

import inspect
from itertools import product
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

import mmferry.models
import mmferry.server.http
from mmferry.cli import main
from mmferry.cli.args import CHECKS, RULES, validate
from mmferry.errors import ArgumentError


def _commands(group: click.Group = main, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], click.Command]:
    out: dict[tuple[str, ...], click.Command] = {}
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            out.update(_commands(cmd, (*path, name)))
        else:
            out[(*path, name)] = cmd
    return out


COMMANDS = _commands()

# What each command needs besides the bad option, so only that option is wrong.
BASE = {("encode",): ["--samples", "1"], ("audit",): ["qwen2-vl"]}

# A bad value of each option with a check.
BAD = {
    "model_name": ["--model", "nope"],
    "model_names": ["nope"],
    "weights": ["--weights", "/nonexistent"],
    "device": ["--device", "xpu"],
    "simulated_device": ["--device", "not-a-device"],
    "dtype": ["--dtype", "int8"],
    "out": ["--out", "emb.txt"],
    "samples": ["--samples", "0"],
    "max_tokens_per_step": ["--max-tokens-per-step", "0"],
    "server": ["--server", "ftp://host"],
    "host": ["--host", "bad host!"],
    "port": ["--port", "70000"],
    "api_keys": ["--api-key", "short"],
    "workers": ["--workers", "0"],
    "max_inflight": ["--max-inflight", "0"],
    "max_request_bytes": ["--max-request-bytes", "lots"],
    "max_media_bytes": ["--max-media-bytes", "0"],
    "max_image_pixels": ["--max-image-pixels", "0"],
    "max_items": ["--max-items", "0"],
    "max_redirects": ["--max-redirects", "-1"],
    "fetch_timeout": ["--fetch-timeout", "image=-1"],
    "allowed_media_domains": ["--allowed-media-domains", "http://example.com/"],
    "allow_private_addresses": ["--allowed-media-domains", "example.com",
                                "--allow-private-addresses", "10.0.0.300/8"],
    "allowed_local_media_path": ["--allowed-local-media-path", "/nonexistent"],
    "max_batch_tokens": ["--max-batch-tokens", "0"],
    "batch_wait_ms": ["--batch-wait-ms", "-1"],
    "cache_max_tokens": ["--cache-max-tokens", "0"],
    "min_render_replicas": ["--min-render-replicas", "-1"],
    "max_render_replicas": ["--max-render-replicas", "0"],
    "encoder_replicas": ["--encoder-replicas", "0"],
    "render_cpus": ["--render-cpus", "-1"],
    "encoder_cpus": ["--encoder-cpus", "-1"],
    "encoder_gpus": ["--encoder-gpus", "-0.5"],
    "ingress_cpus": ["--ingress-cpus", "-1"],
    "imbalance_threshold": ["--imbalance-threshold", "-1"],
    "router": ["--router", "random"],
}

CASES = [(path, option) for path, option in product(COMMANDS, CHECKS)
         if option in {p.name for p in COMMANDS[path].params}]


@pytest.fixture
def nothing_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """A usage error must come before any model is loaded or port bound."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("reached a model load or a bind with a bad option")

    monkeypatch.setattr(mmferry.models, "load", refuse)
    monkeypatch.setattr(mmferry.server.http, "bind", refuse)


@pytest.mark.parametrize(("path", "option"), CASES, ids=[f"{' '.join(p)}:{o}" for p, o in CASES])
def test_every_check_runs_for_every_command_with_the_option(
        nothing_starts: None, path: tuple[str, ...], option: str) -> None:
    result = CliRunner().invoke(main, [*path, *BASE.get(path, []), *BAD[option]])
    assert result.exit_code == 2, result.output
    assert CHECKS[option].flag in result.output


def test_every_check_is_reached_and_has_a_bad_value() -> None:
    assert set(BAD) == set(CHECKS)
    assert {option for _, option in CASES} == set(CHECKS)


def test_the_servers_share_the_network_and_media_options() -> None:
    render, serve = ({p.name for p in COMMANDS[c].params} for c in (("launch", "render"), ("serve",)))
    shared = {"host", "port", "api_keys", "max_request_bytes", "allowed_media_domains",
              "allow_private_addresses", "allowed_local_media_path", "max_media_bytes",
              "max_image_pixels", "max_items", "fetch_timeout", "max_redirects", "model_name",
              "weights"}
    assert shared <= render and shared <= serve


@pytest.mark.parametrize("rule", range(len(RULES)))
def test_every_rule_applies_to_some_command(rule: int) -> None:
    needs, _ = RULES[rule]
    assert any(needs <= {p.name for p in cmd.params} for cmd in COMMANDS.values())


def test_validate_knows_no_command_names() -> None:
    assert list(inspect.signature(validate).parameters) == ["ns"]
    # The same options in any namespace get the same checks and rules.
    with pytest.raises(ArgumentError, match="--max-batch-tokens"):
        validate({"max_batch_tokens": 10, "cache_max_tokens": 5})
    with pytest.raises(ArgumentError, match="--allow-private-addresses"):
        validate({"allow_private_addresses": "all", "allowed_media_domains": ()})
    ok = validate({"max_media_bytes": "2MiB", "fetch_timeout": "image=2,audio=4",
                   "allow_private_addresses": "127.0.0.0/8", "unrelated": object()})
    assert ok["max_media_bytes"] == 2 << 20
    assert ok["fetch_timeout"] == {"image": 2.0, "audio": 4.0}
    assert ok["allow_private_addresses"][0] is False
    assert str(ok["allow_private_addresses"][1][0]) == "127.0.0.0/8"


@pytest.mark.parametrize("path", [("launch", "render"), ("serve",), ("launch", "ray")])
def test_server_help_needs_no_gpu(path: tuple[str, ...]) -> None:
    result = CliRunner().invoke(main, [*path, "--help"])
    assert result.exit_code == 0 and "--allowed-media-domains" in result.output


@pytest.mark.parametrize(("args", "flag"), [
    (["encode", "--samples", "1", "--server", "http://127.0.0.1:1", "--weights", "{ckpt}"],
     "--server"),
    (["audit", "--all", "qwen2-vl"], "--all"),
    (["encode"], "FILES"),
    (["serve", "--max-batch-tokens", "100", "--cache-max-tokens", "50"], "--max-batch-tokens"),
    (["launch", "render", "--allow-private-addresses"], "--allow-private-addresses"),
    (["launch", "ray", "--port", "0"], "--port"),
    (["launch", "ray", "--min-render-replicas", "3", "--max-render-replicas", "2"],
     "--min-render-replicas"),
    (["encode", "--samples", "1", "--model", "qwen2-audio", "--pixel-dtype", "float32"],
     "--pixel-dtype"),
    (["launch", "render", "--model", "firered-lid", "--resize-mode", "exact"], "--resize-mode"),
])
def test_rules_are_usage_errors(nothing_starts: None, tmp_path: Path, args: list[str],
                                flag: str) -> None:
    (tmp_path / "config.json").write_text("{}")
    result = CliRunner().invoke(main, [a.format(ckpt=tmp_path) for a in args])
    assert result.exit_code == 2, result.output
    assert flag in result.output
