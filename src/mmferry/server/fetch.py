"""Fetching media URLs without becoming a proxy into the server's network (SSRF).

Off unless domains are allowed. For each hop: the host must be allowed; its name is
resolved once here and every address it resolves to must be public (not private,
loopback, link-local, multicast, reserved or unspecified) unless that network is
explicitly allowed; the connection goes to the checked address (the URL's host rides in the
``Host`` header and the TLS server name, so certificates are still verified against it).
Redirects are followed by hand, each one re-checked, at most ``max_redirects``. Bytes are
counted while they stream and the fetch stops at the cap; the whole fetch has a deadline
per modality. Every refusal is a :class:`~mmferry.server.errors.ServerError` (422).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

import httpx

from mmferry.server.errors import ServerError

__all__ = ["FetchPolicy", "address_allowed", "domain_allowed", "fetch"]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

_REDIRECTS = (301, 302, 303, 307, 308)
_DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True)
class FetchPolicy:
    """``allowed_domains``: empty turns fetching off; ``"*"`` allows any host; an entry
    ``*.example.com`` allows its subdomains; any other entry one host exactly.
    ``private_networks``: non-public networks that may still be reached; ``all_private``
    allows every address (tests, trusted networks)."""

    allowed_domains: tuple[str, ...] = ()
    private_networks: tuple[IPNetwork, ...] = ()
    all_private: bool = False
    max_bytes: int = 32 << 20
    timeouts: Mapping[str, float] = field(
        default_factory=lambda: {"image": 5.0, "video": 30.0, "audio": 10.0})
    default_timeout: float = 10.0
    max_redirects: int = 5

    @property
    def enabled(self) -> bool:
        return bool(self.allowed_domains)


def domain_allowed(host: str, allowed: tuple[str, ...]) -> bool:
    host = host.lower().rstrip(".")
    for entry in allowed:
        entry = entry.lower().rstrip(".")
        if entry == "*" or entry == host:
            return True
        if entry.startswith("*.") and host.endswith(entry[1:]):
            return True
    return False


def address_allowed(address: IPAddress, policy: FetchPolicy) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if policy.all_private:
        return True
    if any(address in net for net in policy.private_networks):
        return True
    return address.is_global and not address.is_multicast


async def _resolve(host: str, port: int) -> list[IPAddress]:
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        pass
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]


async def _checked_address(url: httpx.URL, policy: FetchPolicy, item: int, hop: int) -> IPAddress:
    where = "redirect target" if hop else "url"
    if url.scheme not in _DEFAULT_PORTS:
        raise ServerError(422, "media_fetch_failed", f"{where} scheme {url.scheme!r} is not http(s)",
                          item, "url")
    host = url.host
    if not host or not domain_allowed(host, policy.allowed_domains):
        raise ServerError(422, "domain_not_allowed",
                          f"{where} host {host!r} is not in --allowed-media-domains", item, "url")
    port = url.port or _DEFAULT_PORTS[url.scheme]
    try:
        addresses = await _resolve(host, port)
    except OSError as e:
        raise ServerError(422, "media_fetch_failed", f"cannot resolve {host!r} ({e})", item,
                          "url") from None
    refused = [a for a in addresses if not address_allowed(a, policy)]
    if refused or not addresses:
        raise ServerError(422, "address_not_allowed",
                          f"{where} host {host!r} resolves to {refused[0] if refused else 'nothing'}"
                          ", a non-public address (see --allow-private-addresses)", item, "url")
    return addresses[0]


async def _fetch(url: str, policy: FetchPolicy, client: httpx.AsyncClient, item: int) -> bytes:
    try:
        target = httpx.URL(url)
    except (httpx.InvalidURL, TypeError) as e:
        raise ServerError(400, "bad_request", f"not a URL ({e})", item, "url") from None
    for hop in range(policy.max_redirects + 1):
        address = await _checked_address(target, policy, item, hop)
        host_header = target.netloc.decode("ascii")
        extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
        pinned = target.copy_with(host=str(address))
        request = client.build_request("GET", pinned, headers={"Host": host_header,
                                                "Accept-Encoding": "identity"},
                                       extensions=extensions)
        response = await client.send(request, stream=True, follow_redirects=False)
        try:
            if response.status_code in _REDIRECTS and "location" in response.headers:
                target = target.join(response.headers["location"])
                continue
            if response.status_code != 200:
                raise ServerError(422, "media_fetch_failed",
                                  f"{url} answered HTTP {response.status_code}", item, "url")
            declared = response.headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > policy.max_bytes:
                raise ServerError(422, "media_too_large", f"{url} is {declared} bytes, more than "
                                  f"--max-media-bytes {policy.max_bytes}", item, "url")
            chunks, total = [], 0
            async for chunk in response.aiter_raw():
                total += len(chunk)
                if total > policy.max_bytes:
                    raise ServerError(422, "media_too_large", f"{url} sent more than "
                                      f"--max-media-bytes {policy.max_bytes}", item, "url")
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            await response.aclose()
    raise ServerError(422, "media_fetch_failed",
                      f"{url}: more than {policy.max_redirects} redirects", item, "url")


async def fetch(url: str, modality: str, policy: FetchPolicy, client: httpx.AsyncClient,
                *, item: int) -> bytes:
    """The body of ``url`` under ``policy``; a 422 :class:`ServerError` on any refusal,
    failure or timeout (the client's URL, never the server's fault)."""
    if not policy.enabled:
        raise ServerError(422, "url_not_allowed", "fetching URLs is off on this server "
                          "(start it with --allowed-media-domains)", item, "url")
    timeout = policy.timeouts.get(modality, policy.default_timeout)
    try:
        return await asyncio.wait_for(_fetch(url, policy, client, item), timeout)
    except asyncio.TimeoutError:
        raise ServerError(422, "media_fetch_timeout", f"{url} took more than {timeout} s",
                          item, "url") from None
    except httpx.HTTPError as e:
        raise ServerError(422, "media_fetch_failed", f"{url}: {type(e).__name__} {e}", item,
                          "url") from None
