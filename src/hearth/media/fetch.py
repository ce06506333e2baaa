"""The bytes behind a media URL: `data:` URLs decoded, http(s) URLs fetched when the operator
allows it (`--allow-fetch`), and never from the machine's own networks.

A server that fetches what a request names can be made to reach what only it can reach (its
loopback services, the cloud metadata address, the private network): server-side request
forgery. So every host is resolved here, every address it resolves to must be public, and the
connection goes to the address that was checked (a second lookup could answer differently: DNS
rebinding). Redirects are followed by hand, a few at most, each target checked the same way.
The body is streamed and refused as soon as it passes the byte limit; the whole fetch, every
hop included, has one deadline. http.client is used rather than urllib, which would follow
redirects itself and honour proxy variables from the environment.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import ipaddress
import socket
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote_to_bytes, urljoin, urlsplit

from hearth.media import MAX_MEDIA_BYTES, MediaError

FETCH_SECONDS = 10.0  # the whole fetch, redirects included
MAX_REDIRECTS = 3
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
FETCH_OFF = (
    "fetching media from http(s) URLs is off: start the server (or the CLI) with "
    "--allow-fetch, or send the file inline (a data: URL or base64)"
)
_READ_CHUNK = 64 * 1024

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class FetchPolicy:
    """Whether and how far http(s) URLs are fetched. `trust_first_hop` is for tests only: the
    first request may reach any address (a loopback test server), so that what refuses a
    redirect to loopback is the redirect's own check."""

    allowed: bool = False
    max_bytes: int = MAX_MEDIA_BYTES
    seconds: float = FETCH_SECONDS
    max_redirects: int = MAX_REDIRECTS
    trust_first_hop: bool = False


def read_media_url(url: str, policy: FetchPolicy) -> bytes:
    """The bytes a media URL names: a `data:` URL always; http(s) only where `policy` allows."""
    scheme = url.partition(":")[0].lower()
    if scheme == "data":
        return decode_data_url(url, policy.max_bytes)
    if scheme not in ("http", "https"):
        shown = scheme if len(scheme) < 20 else scheme[:20] + "..."
        raise MediaError(f"a media URL must be data:, http: or https:, not {shown}:")
    if not policy.allowed:
        raise MediaError(FETCH_OFF)
    return fetch(url, policy)


def decode_data_url(url: str, max_bytes: int = MAX_MEDIA_BYTES) -> bytes:
    """The payload of `data:[<media type>][;base64],<data>` (RFC 2397): base64, or
    percent-encoded bytes without `;base64`."""
    header, comma, payload = url.partition(",")
    if not comma or not header.lower().startswith("data:"):
        raise MediaError("a data: URL must look like data:<media type>;base64,<data>")
    if header.lower().endswith(";base64"):
        return decode_base64(payload, max_bytes)
    data = unquote_to_bytes(payload)
    _check_length(len(data), max_bytes)
    return data


def decode_base64(text: str, max_bytes: int = MAX_MEDIA_BYTES) -> bytes:
    """Base64 (standard or URL-safe alphabet, line breaks allowed), refused unread when its
    length alone says the bytes would pass `max_bytes`."""
    compact = "".join(text.split())
    _check_length(len(compact) * 3 // 4 - compact.count("="), max_bytes)
    if "-" in compact or "_" in compact:
        compact = compact.replace("-", "+").replace("_", "/")
    try:
        return base64.b64decode(compact + "=" * (-len(compact) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("the base64 data is malformed") from None


def _check_length(size: int, max_bytes: int) -> None:
    if size > max_bytes:
        raise MediaError(f"the file has {size} bytes; at most {max_bytes} are accepted")


def refusal(address: IPAddress) -> str | None:
    """Why a request must not go to `address` (None: it is a public address)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # ::ffff:127.0.0.1 reaches 127.0.0.1
    checks = (
        ("loopback", address.is_loopback),
        ("unspecified", address.is_unspecified),
        ("link-local", address.is_link_local),
        ("multicast", address.is_multicast),
        ("reserved", address.is_reserved),
        ("private", address.is_private),
        ("not globally routable", not address.is_global),
    )
    return next((name for name, failed in checks if failed), None)


def public_addresses(host: str, port: int) -> list[str]:
    """The addresses to connect to for `host`: every address it resolves to must be public (a
    name that also resolves to a private one could be switched to it between two lookups)."""
    addresses = _resolve(host, port)
    for address in addresses:
        reason = refusal(ipaddress.ip_address(address))
        if reason is not None:
            raise MediaError(
                f"refused to fetch from {host}: it resolves to {address}, a {reason} address "
                "(only public addresses are fetched)"
            )
    return addresses


def _resolve(host: str, port: int) -> list[str]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as error:
        raise MediaError(f"cannot resolve the host {host}: {error}") from None
    # Without the scope of a link-local IPv6 address (fe80::1%eth0): it is refused anyway.
    addresses = list(dict.fromkeys(str(info[4][0]).split("%")[0] for info in infos))
    if not addresses:
        raise MediaError(f"the host {host} has no address")
    return addresses


def fetch(url: str, policy: FetchPolicy) -> bytes:
    """GET `url`, following up to `policy.max_redirects` redirects, each target checked."""
    deadline = time.monotonic() + policy.seconds
    for hop in range(policy.max_redirects + 1):
        trusted = policy.trust_first_hop and hop == 0
        answer = _get(url, policy, deadline, trusted)
        if isinstance(answer, bytes):
            return answer
        url = urljoin(url, answer)
        if urlsplit(url).scheme.lower() not in ("http", "https"):
            raise MediaError(f"a redirect led to {url.split(':')[0]}:, not http(s)")
    raise MediaError(f"more than {policy.max_redirects} redirects fetching the media URL")


def _get(url: str, policy: FetchPolicy, deadline: float, trusted: bool) -> bytes | str:
    """One request: the body, or the Location of a redirect."""
    parts = urlsplit(url)
    host = parts.hostname
    if not host:
        raise MediaError(f"the URL {url!r} has no host")
    https = parts.scheme.lower() == "https"
    try:
        port = parts.port or (443 if https else 80)
    except ValueError:
        raise MediaError(f"the URL {url!r} has a bad port") from None
    addresses = _resolve(host, port) if trusted else public_addresses(host, port)
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    connection = None
    try:
        connection = _pinned_connection(host, port, addresses, https, _remaining(deadline))
        connection.request("GET", path, headers={"User-Agent": "hearth", "Accept": "*/*"})
        response = connection.getresponse()
        if response.status in REDIRECT_STATUSES:
            location = response.getheader("Location")
            if not location:
                raise MediaError(f"{host} answered a redirect without a Location")
            return location
        if response.status != 200:
            raise MediaError(f"fetching the media URL: {host} answered HTTP {response.status}")
        return _read_body(response, connection, policy.max_bytes, deadline)
    except TimeoutError:
        raise MediaError(f"fetching the media URL took over {policy.seconds:g} s") from None
    except (OSError, http.client.HTTPException) as error:
        raise MediaError(f"fetching the media URL from {host} failed: {error}") from None
    finally:
        if connection is not None:
            connection.close()


def _pinned_connection(
    host: str, port: int, addresses: list[str], https: bool, timeout: float
) -> http.client.HTTPConnection:
    """A connection to `host` (its Host header, TLS name and certificate check) whose socket
    goes to one of `addresses`, those that were checked, without a second lookup."""
    kind = http.client.HTTPSConnection if https else http.client.HTTPConnection
    connection = kind(host, port, timeout=timeout)

    def connect_to_checked(target: tuple[str, int], *args: Any, **kwargs: Any) -> socket.socket:
        failure: OSError | None = None
        for address in addresses:  # in the resolver's order, as socket.create_connection does
            try:
                return socket.create_connection((address, target[1]), *args, **kwargs)
            except OSError as error:
                failure = error
        raise failure or OSError(f"{host} has no address")

    # http.client opens its socket through this attribute (plain and TLS connections alike).
    connection._create_connection = connect_to_checked  # type: ignore[attr-defined]
    return connection


def _read_body(
    response: http.client.HTTPResponse,
    connection: http.client.HTTPConnection,
    max_bytes: int,
    deadline: float,
) -> bytes:
    declared = response.getheader("Content-Length", "")
    if declared.isdigit():
        _check_length(int(declared), max_bytes)
    body = bytearray()
    while True:
        if connection.sock is not None:
            connection.sock.settimeout(_remaining(deadline))
        chunk = response.read(_READ_CHUNK)
        if not chunk:
            return bytes(body)
        body += chunk
        if len(body) > max_bytes:
            raise MediaError(f"the file has over {max_bytes} bytes; at most that is accepted")


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left
