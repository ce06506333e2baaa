"""Media URLs (`hearth.media.fetch`): data: URLs decoded, http(s) fetched only when allowed, and
the SSRF guard: loopback, private, link-local and other non-public targets refused, directly,
through a name that resolves to one, and through a redirect.

A loopback HTTP server plays the far end. The guard refuses it, so the tests that need it to
answer (a redirect that the redirect's own check must refuse) set `trust_first_hop`, a
test-only switch that lets just the first request through.
"""

from __future__ import annotations

import base64
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar
from urllib.parse import quote_from_bytes

import pytest

from hearth.media import MediaError
from hearth.media.fetch import FetchPolicy, decode_base64, decode_data_url, read_media_url

PAYLOAD = bytes(range(256)) * 4
ALLOWED = FetchPolicy(allowed=True)
FIRST_HOP_TRUSTED = FetchPolicy(allowed=True, trust_first_hop=True)


class _Far(BaseHTTPRequestHandler):
    """The far end: a file, redirects to wherever the path says, a big or slow body."""

    hits: ClassVar[list[tuple[str, str]]] = []  # (path, Host header) of each request

    def do_GET(self) -> None:
        self.hits.append((self.path, self.headers.get("Host", "")))
        port = self.server.server_address[1]
        if self.path == "/file":
            self._send(200, PAYLOAD)
        elif self.path.startswith("/to/"):
            target = self.path.removeprefix("/to/").replace("PORT", str(port))
            self.send_response(302)
            self.send_header("Location", target)
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path == "/endless":  # no Content-Length: only the streamed count can stop it
            self.send_response(200)
            self.end_headers()
            try:
                for _ in range(1000):
                    self.wfile.write(b"x" * 65536)
            except OSError:
                pass  # the client hung up, as it should
        elif self.path == "/declared-huge":
            self.send_response(200)
            self.send_header("Content-Length", str(10**12))
            self.end_headers()
        elif self.path == "/slow":
            time.sleep(2)
            with contextlib.suppress(OSError):  # the client gave up, as it should
                self._send(200, PAYLOAD)
        else:
            self._send(404, b"")

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def far() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Far)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(autouse=True)
def _fresh_hits() -> None:
    _Far.hits.clear()


def test_the_far_end_serves_when_the_first_hop_is_trusted(far: str) -> None:
    """The machinery works: without this, the refusals below could be a broken fetch."""
    assert read_media_url(f"{far}/file", FIRST_HOP_TRUSTED) == PAYLOAD


@pytest.mark.parametrize(
    ("host", "reason"),
    [
        ("127.0.0.1", "loopback"),
        ("127.8.9.10", "loopback"),
        ("localhost", "loopback"),
        ("[::1]", "loopback"),
        ("[::ffff:127.0.0.1]", "loopback"),  # IPv4-mapped IPv6 reaches 127.0.0.1
        ("10.1.2.3", "private"),
        ("172.16.0.1", "private"),
        ("192.168.1.1", "private"),
        ("[fd00::1]", "private"),
        ("[::ffff:192.168.1.1]", "private"),
        ("169.254.169.254", "link-local"),  # the cloud metadata service
        ("[fe80::1]", "link-local"),
        ("0.0.0.0", "unspecified"),
        ("[::]", "unspecified"),
        ("224.0.0.1", "multicast"),
        ("[ff02::1]", "multicast"),
        ("240.0.0.1", "reserved"),
        ("100.64.0.1", "not globally routable"),  # carrier-grade NAT space
    ],
)
def test_non_public_targets_are_refused(host: str, reason: str) -> None:
    with pytest.raises(MediaError, match=f"a {reason} address"):
        read_media_url(f"http://{host}:9/image.png", ALLOWED)


def test_the_loopback_server_itself_is_refused_without_the_test_switch(far: str) -> None:
    with pytest.raises(MediaError, match="loopback"):
        read_media_url(f"{far}/file", ALLOWED)
    assert _Far.hits == []


@pytest.mark.parametrize(
    ("target", "reason"),
    [
        ("http://127.0.0.1:PORT/file", "loopback"),
        ("http://localhost:PORT/file", "loopback"),
        ("http://10.0.0.7/file", "private"),
        ("http://169.254.169.254/latest/meta-data/", "link-local"),
        ("http://[::1]:PORT/file", "loopback"),
    ],
)
def test_a_redirect_to_a_non_public_target_is_refused(far: str, target: str, reason: str) -> None:
    """The first hop (trusted) answers 302; the redirect's target is checked and refused, and
    it is never requested (the server sees only the redirect)."""
    with pytest.raises(MediaError, match=f"a {reason} address"):
        read_media_url(f"{far}/to/{target}", FIRST_HOP_TRUSTED)
    assert [path for path, _ in _Far.hits] == [f"/to/{target}"]


def test_redirects_are_limited(far: str) -> None:
    policy = FetchPolicy(allowed=True, trust_first_hop=True, max_redirects=0)
    with pytest.raises(MediaError, match="more than 0 redirects"):
        read_media_url(f"{far}/to/http://example.com/", policy)


def test_a_redirect_to_another_scheme_is_refused(far: str) -> None:
    with pytest.raises(MediaError, match="not http"):
        read_media_url(f"{far}/to/file:///etc/passwd", FIRST_HOP_TRUSTED)


def test_every_address_of_a_name_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """A name resolving to a public and a private address is refused: a later lookup could
    pick the private one."""

    def resolve(host: str, port: int, *args: Any, **kwargs: Any) -> list[Any]:
        assert host == "mixed.example"
        return [
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("93.184.216.34", port)),
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.1", port)),
        ]

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    with pytest.raises(MediaError, match=r"10\.0\.0\.1, a private address"):
        read_media_url("http://mixed.example/a.png", ALLOWED)


def test_the_connection_goes_to_the_checked_address(
    far: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One lookup per hop, and the socket opens to its answer while the request still names
    the host (Host header): a second lookup that could answer differently never happens."""
    port = int(far.rpartition(":")[2])
    real = socket.getaddrinfo
    lookups: list[str] = []

    def resolve(host: str, *args: Any, **kwargs: Any) -> list[Any]:
        if host == "pinned.example":
            lookups.append(host)
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))]
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    assert read_media_url(f"http://pinned.example:{port}/file", FIRST_HOP_TRUSTED) == PAYLOAD
    assert lookups == ["pinned.example"]
    assert _Far.hits == [("/file", f"pinned.example:{port}")]


def test_a_body_over_the_limit_is_refused_while_streaming(far: str) -> None:
    policy = FetchPolicy(allowed=True, trust_first_hop=True, max_bytes=100_000)
    started = time.monotonic()
    with pytest.raises(MediaError, match="over 100000 bytes"):
        read_media_url(f"{far}/endless", policy)
    # The endless body is 65 MB; stopping at the limit takes a few reads, well under a second.
    assert time.monotonic() - started < 5


def test_a_declared_length_over_the_limit_is_refused_unread(far: str) -> None:
    with pytest.raises(MediaError, match="1000000000000 bytes"):
        read_media_url(f"{far}/declared-huge", FIRST_HOP_TRUSTED)


def test_a_slow_server_hits_the_time_limit(far: str) -> None:
    policy = FetchPolicy(allowed=True, trust_first_hop=True, seconds=0.3)
    with pytest.raises(MediaError, match=r"took over 0\.3 s"):
        read_media_url(f"{far}/slow", policy)


@pytest.mark.parametrize(
    "url", ["file:///etc/passwd", "ftp://example.com/a.png", "gopher://x/", "javascript:alert(1)"]
)
def test_other_schemes_are_refused(url: str) -> None:
    with pytest.raises(MediaError, match="must be data:, http: or https:"):
        read_media_url(url, ALLOWED)


def test_fetching_is_off_by_default_and_says_how_to_turn_it_on(far: str) -> None:
    with pytest.raises(MediaError, match="--allow-fetch"):
        read_media_url("https://example.com/cat.png", FetchPolicy())
    with pytest.raises(MediaError, match="--allow-fetch"):
        read_media_url(f"{far}/file", FetchPolicy(trust_first_hop=True))
    assert _Far.hits == []


def test_data_urls_decode_with_fetching_off() -> None:
    """Base64 (as browsers and SDKs write it, with or without line breaks) and percent-encoded
    payloads, against the stdlib's own encoders."""
    encoded = base64.b64encode(PAYLOAD).decode()
    off = FetchPolicy()
    assert read_media_url(f"data:image/png;base64,{encoded}", off) == PAYLOAD
    wrapped = "\n".join(encoded[i : i + 76] for i in range(0, len(encoded), 76))
    assert read_media_url(f"data:image/png;base64,{wrapped}", off) == PAYLOAD
    assert read_media_url(f"DATA:audio/wav;BASE64,{encoded}", off) == PAYLOAD
    assert read_media_url(f"data:,{quote_from_bytes(PAYLOAD)}", off) == PAYLOAD
    assert read_media_url(f"data:image/svg+xml,{quote_from_bytes(b'<a b=1/>')}", off) == (
        b"<a b=1/>"
    )


def test_base64_variants_and_malformed_data() -> None:
    assert decode_base64(base64.urlsafe_b64encode(PAYLOAD).decode()) == PAYLOAD
    assert decode_base64(base64.b64encode(b"ab").decode().rstrip("=")) == b"ab"
    with pytest.raises(MediaError, match="malformed"):
        decode_base64("not*base64!")
    with pytest.raises(MediaError, match="data:<media type>;base64,<data>"):
        decode_data_url("data:image/png;base64")


def test_data_over_the_limit_is_refused_before_decoding() -> None:
    encoded = base64.b64encode(b"\0" * 3000).decode()
    with pytest.raises(MediaError, match="3000 bytes; at most 1000"):
        decode_base64(encoded, max_bytes=1000)
    with pytest.raises(MediaError, match="at most 1000"):
        decode_data_url("data:," + "%00" * 1001, max_bytes=1000)
