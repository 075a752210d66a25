"""The servers' pure parts: the fetch policy's address and domain checks, the frames body."""

from __future__ import annotations

import ipaddress

import pytest

from mmferry.errors import WireError
from mmferry.server.fetch import FetchPolicy, address_allowed, domain_allowed
from mmferry.server.frames import decode_body, encode_body

ip = ipaddress.ip_address


@pytest.mark.parametrize("address", [
    "127.0.0.1", "127.9.9.9", "10.0.0.1", "172.16.5.5", "192.168.1.1", "169.254.169.254",
    "100.64.0.1", "0.0.0.0", "224.0.0.1", "255.255.255.255", "::1", "fe80::1", "fc00::1",
    "::ffff:127.0.0.1", "::ffff:169.254.169.254", "::",
])
def test_non_public_addresses_are_refused(address: str) -> None:
    assert not address_allowed(ip(address), FetchPolicy(allowed_domains=("*",)))


@pytest.mark.parametrize("address", ["93.184.215.14", "2606:2800:21f:cb07:6820:80da:af6b:8b2c"])
def test_public_addresses_are_allowed(address: str) -> None:
    assert address_allowed(ip(address), FetchPolicy(allowed_domains=("*",)))


def test_allowed_networks_open_only_themselves() -> None:
    policy = FetchPolicy(allowed_domains=("*",),
                         private_networks=(ipaddress.ip_network("127.0.0.2/32"),))
    assert address_allowed(ip("127.0.0.2"), policy)
    assert not address_allowed(ip("127.0.0.1"), policy)
    assert not address_allowed(ip("169.254.169.254"), policy)
    assert address_allowed(ip("169.254.169.254"), FetchPolicy(all_private=True))


@pytest.mark.parametrize(("host", "allowed", "ok"), [
    ("example.com", ("example.com",), True),
    ("EXAMPLE.com.", ("example.com",), True),
    ("cdn.example.com", ("example.com",), False),
    ("cdn.example.com", ("*.example.com",), True),
    ("example.com", ("*.example.com",), False),
    ("evilexample.com", ("*.example.com",), False),
    ("anything.org", ("*",), True),
    ("anything.org", (), False),
])
def test_domains(host: str, allowed: tuple[str, ...], ok: bool) -> None:
    assert domain_allowed(host, allowed) is ok


def test_frames_body_round_trip_and_refusals() -> None:
    frames = [b"meta", b"", b"x" * 1000]
    body = b"".join(encode_body(frames))
    assert [bytes(f) for f in decode_body(body)] == frames
    for bad in (body[:3], body[:-1], body + b"!", b"\x00\x00\x00\x00", b"\xff\xff\xff\xff" + body[4:]):
        with pytest.raises(WireError):
            decode_body(bad)
