"""`onceflow serve --http`'s bind address, bounds and bearer tokens. Trio thread (plain data; the token
file is read once, at start)."""

from __future__ import annotations

import hmac
import ipaddress
import math
from pathlib import Path
from typing import Literal

import attrs

from onceflow.protocol.limits import MAX_MESSAGE_BYTES

Role = Literal["read", "write"]
"""What a bearer token may do: `read` (GET routes and the read-only commands) or `write` (everything)."""

MAX_TOKEN_FILE_BYTES = 64 * 1024
MIN_TOKEN_CHARS = 16


class BindError(ValueError):
    """`--http HOST:PORT` cannot be served as asked (bad address, or a non-loopback bind without tokens)."""


def _positive(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{attribute.name} must be a finite number of seconds > 0, not {value!r}")


@attrs.frozen
class Tokens:
    """Bearer tokens and their roles. `role_of` compares in constant time (no early exit on a prefix)."""

    entries: tuple[tuple[str, Role], ...] = ()

    @property
    def required(self) -> bool:
        """Whether requests must carry a token (any token file given)."""
        return bool(self.entries)

    def role_of(self, token: str) -> Role | None:
        """The role of `token`, or None when it is no known token."""
        found: Role | None = None
        for known, role in self.entries:
            if hmac.compare_digest(known.encode(), token.encode()):
                found = role
        return found

    @classmethod
    def load(cls, path: Path) -> Tokens:
        """Read a token file: one token a line, `write TOKEN` or `read TOKEN` (a bare `TOKEN` is `write`);
        blank lines and lines starting with `#` are skipped. At most 64 KiB; each token at least 16
        characters of printable ASCII without spaces.

        Raises:
            ValueError: the file is too large, empty of tokens, or a line is malformed (naming the line).
            OSError: it cannot be read.
        """
        data = path.read_bytes()
        if len(data) > MAX_TOKEN_FILE_BYTES:
            raise ValueError(f"{path}: larger than {MAX_TOKEN_FILE_BYTES} bytes")
        entries: list[tuple[str, Role]] = []
        for number, raw in enumerate(data.decode("utf-8").splitlines(), start=1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split()
            role: str = "write"
            if len(parts) == 2:
                role, token = parts
            elif len(parts) == 1:
                token = parts[0]
            else:
                raise ValueError(f"{path}:{number}: expected `read TOKEN`, `write TOKEN` or `TOKEN`")
            if role not in ("read", "write"):
                raise ValueError(f"{path}:{number}: role must be read or write, not {role!r}")
            if len(token) < MIN_TOKEN_CHARS or not (token.isascii() and token.isprintable()):
                raise ValueError(
                    f"{path}:{number}: a token is at least {MIN_TOKEN_CHARS} printable ASCII characters"
                )
            entries.append((token, "read" if role == "read" else "write"))
        if not entries:
            raise ValueError(f"{path}: holds no token")
        return cls(tuple(entries))


@attrs.frozen
class HttpOptions:
    """The HTTP listener: `host` and `port` to bind (port 0: any free one); `tokens` (none: no token is
    asked, allowed only on a loopback address); `cors_origins` allowed to call the API from a browser page
    of another origin (empty: CORS off); `max_body` bytes in a request body (default and at most the
    protocol's message limit); `max_header` bytes of a request's line and headers; `keep_alive` seconds an
    idle kept-alive connection stays open; `read_timeout` seconds a request may take to arrive;
    `heartbeat` seconds between SSE keep-alive comments; `max_connections` HTTP connections at once (None:
    the socket's cap)."""

    host: str = "127.0.0.1"
    port: int = attrs.field(default=8080, validator=[attrs.validators.ge(0), attrs.validators.le(65535)])
    tokens: Tokens = Tokens()
    cors_origins: tuple[str, ...] = ()
    max_body: int = attrs.field(
        default=MAX_MESSAGE_BYTES, validator=[attrs.validators.ge(1), attrs.validators.le(MAX_MESSAGE_BYTES)]
    )
    max_header: int = attrs.field(default=16 * 1024, validator=attrs.validators.ge(1024))
    keep_alive: float = attrs.field(default=30.0, validator=_positive)
    read_timeout: float = attrs.field(default=30.0, validator=_positive)
    heartbeat: float = attrs.field(default=15.0, validator=_positive)
    max_connections: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.ge(1))
    )

    def __attrs_post_init__(self) -> None:
        if not self.tokens.required and not is_loopback(self.host):
            raise BindError(f"--http {self.host}: a non-loopback address needs --token-file (bearer tokens)")


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address (`localhost`, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_bind(text: str) -> tuple[str, int]:
    """`HOST:PORT`, `[V6]:PORT` or `:PORT` (127.0.0.1) to (host, port). Raises BindError naming the part."""
    host, sep, port_text = text.rpartition(":")
    if not sep:
        raise BindError(f"--http {text!r}: expected HOST:PORT")
    host = host.strip("[]") or "127.0.0.1"
    try:
        port = int(port_text)
    except ValueError:
        raise BindError(f"--http {text!r}: port must be an integer") from None
    if not 0 <= port <= 65535:
        raise BindError(f"--http {text!r}: port must be 0 to 65535")
    if host != "localhost":
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise BindError(f"--http {text!r}: host must be an IP address or localhost") from None
    return host, port
