"""The relay's configuration: one frozen dataclass, validated once, with documented units.

Every field is also a command-line flag (``max_clients`` is ``--max-clients``) and a key
of the TOML config file (``max-clients = 500``; ``max_clients`` is accepted too). The
help text of each flag lives in the field's metadata, so the three spellings never drift
apart. :func:`from_mapping` turns already-merged raw values (file, environment, flags)
into a :class:`RelayConfig` and says clearly what is wrong when something is.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from p2pdist.errors import UsageError
from p2pdist.eventloop import LOOP_CHOICES
from p2pdist.transport.relay_config import CLIENT_KEEPALIVE
from p2pdist.wire.relay import (
    MAX_BODY,
    MAX_KEEPALIVE,
    MAX_RETRY_AFTER,
    MAX_TOKEN_BYTES,
    ascii_host,
)

__all__ = [
    "DEFAULT_BURST",
    "ConfigError",
    "RelayConfig",
    "coerce",
    "from_mapping",
    "normalize_keys",
    "option_names",
]

TOKEN_ENV = "P2PDIST_RELAY_TOKEN"
MIN_INTERVAL = 0.1
"""Shortest keepalive and auth-timeout (seconds) the relay starts with."""
MAX_PROXY_HOPS = 16
LOG_LEVELS = ("debug", "info", "warning", "error")
PROXY_CERTS = ("relay", "own")
"""Values of ``proxy-certs``: whose certificates the proxy in front of the http-port serves."""
DEFAULT_BURST = 1 << 20
"""The rate's bucket (bytes) when ``burst`` is not given."""
EVENT_LOOPS = LOOP_CHOICES
"""The names ``--loop`` takes: p2pdist.eventloop's, so the relay and the library agree."""


class ConfigError(ValueError):
    """A configuration value is missing, malformed or inconsistent; the message says which."""


def _doc(help: str, metavar: str | None = None) -> dict[str, str | None]:
    return {"help": help, "metavar": metavar}


@dataclass(frozen=True, slots=True)
class RelayConfig:
    """Everything a relay process is told. Sizes are bytes, times are seconds."""

    host: str = field(default="0.0.0.0", metadata=_doc("address to bind (TCP and STUN)", "ADDR"))
    port: int = field(default=8443, metadata=_doc("TCP port for TLS (0: any free port)", "PORT"))
    public_host: str | None = field(
        default=None,
        metadata=_doc(
            "host name put in the printed URL (default: the bind address; 127.0.0.1 for "
            "0.0.0.0, ::1 for ::)",
            "NAME",
        ),
    )
    public_port: int | None = field(
        default=None,
        metadata=_doc(
            "port put in the printed URL (default: the TLS port): the port clients dial "
            "when it is not the relay's own, behind a port forward or a reverse proxy "
            "(http-port; e.g. 443)",
            "PORT",
        ),
    )
    stun_port: int | None = field(
        default=None,
        metadata=_doc(
            "UDP port answering STUN binding requests (default: same number as the "
            "TCP port; 0 disables)",
            "PORT",
        ),
    )
    stun_alt_port: int | None = field(
        default=None,
        metadata=_doc(
            "second UDP observation port, so clients can tell endpoint-independent from "
            "endpoint-dependent NAT mapping (default: the STUN port + 1, skipped with a "
            "warning if that cannot be bound; 0 disables)",
            "PORT",
        ),
    )
    http_port: int | None = field(
        default=None,
        metadata=_doc(
            "also serve the relay over plain HTTP (no TLS) on this port, for a "
            "TLS-terminating reverse proxy in front of it (nginx, Caddy, a load balancer); "
            "clients reach it through the proxy with WebSocket framing; needs cert and "
            "cert-key, the certificate the proxy serves, unless proxy-certs is own "
            "(default: off; 0: any free port)",
            "PORT",
        ),
    )
    http_host: str = field(
        default="127.0.0.1",
        metadata=_doc(
            "address the plain HTTP port binds: the proxy's side only, never a public one",
            "ADDR",
        ),
    )
    proxy_certs: str = field(
        default="relay",
        metadata=_doc(
            "the certificates of the TLS-terminating proxy in front of the http-port: "
            "relay (it serves the relay's cert files; proofs bind to that certificate) "
            "or own (a managed load balancer or CDN with certificates of its own; "
            "proofs there bind to the relay's name, public-host:public-port, which both "
            "must then name the proxy)",
            "relay|own",
        ),
    )
    proxy_hops: int = field(
        default=1,
        metadata=_doc(
            "reverse proxies of yours in a row in front of the http-port, each appending "
            "to X-Forwarded-For: a client's address is the entry this many from the end "
            "(default 1: the proxy next to the relay; 2 for a TLS-terminating proxy, "
            "serving the relay's certificate files, in front of another). Never more than "
            "you run: the earlier entries are the client's word",
            "N",
        ),
    )
    key: Path | None = field(
        default=None,
        metadata=_doc(
            "pinned mode: the relay's Ed25519 key file (created with mode 0600 if "
            "missing); without --key and --cert an ephemeral key is used",
            "FILE",
        ),
    )
    cert: Path | None = field(
        default=None, metadata=_doc("certificate chain (PEM) of a real certificate", "FILE")
    )
    cert_key: Path | None = field(
        default=None,
        metadata=_doc("private key (PEM) of --cert; must be private (mode 0600)", "FILE"),
    )
    allowlist: Path | None = field(
        default=None,
        metadata=_doc(
            "file of allowed endpoint ids, one per line, '#' comments; reloaded when "
            "it changes and on SIGHUP",
            "FILE",
        ),
    )
    token: str | None = field(
        default=None,
        repr=False,
        metadata=_doc(f"shared token clients must present (or env {TOKEN_ENV})", "TOKEN"),
    )
    max_clients: int = field(default=4096, metadata=_doc("most authenticated clients at once", "N"))
    max_clients_per_ip: int = field(
        default=0,
        metadata=_doc(
            "most authenticated clients from one source address (IPv4 address, IPv6 /64); "
            "0: no cap (a fleet behind one NAT shares one address: set it above the "
            "largest such fleet)",
            "N",
        ),
    )
    max_unauthenticated: int | None = field(
        default=None,
        metadata=_doc(
            "most connections still in the TLS handshake, the HTTP upgrade or AUTH at "
            "once; a new one over it closes the oldest of them if that one waited 1 s, "
            "else gets 503 (closed at once in its TLS handshake) (default: max-clients)",
            "N",
        ),
    )
    max_unauthenticated_per_ip: int = field(
        default=64,
        metadata=_doc(
            "most of those from one source address (IPv4 address, IPv6 /64); the same "
            "rule among that source's connections",
            "N",
        ),
    )
    rate: int = field(
        default=0,
        metadata=_doc(
            "per-client budget in bytes/s on everything it sends from its AUTH on, framing "
            "included, plus 256 per record, 256 per socket read under 1 KiB and 64 per "
            "frame (0: unlimited)",
            "BYTES_PER_S",
        ),
    )
    burst: int | None = field(
        default=None,
        metadata=_doc(
            f"per-client token bucket size in bytes, with rate [default: {DEFAULT_BURST}]",
            "BYTES",
        ),
    )
    queue_bytes: int = field(
        default=1 << 20,
        metadata=_doc(
            "per-client bound on bytes queued towards it; RECVs beyond are dropped", "BYTES"
        ),
    )
    keepalive: float = field(
        default=15.0,
        metadata=_doc(
            "client ping interval advertised in AUTH_OK; silent clients are dropped after 3x",
            "SECONDS",
        ),
    )
    auth_timeout: float = field(
        default=10.0,
        metadata=_doc(
            "time allowed for the TLS handshake, and again from there to a completed AUTH",
            "SECONDS",
        ),
    )
    drain_timeout: float = field(
        default=3.0,
        metadata=_doc(
            "graceful shutdown: how long to let queues drain before connections are aborted",
            "SECONDS",
        ),
    )
    retry_after: float = field(
        default=1.0, metadata=_doc("retry_after advertised in RECONNECT on shutdown", "SECONDS")
    )
    url_file: Path | None = field(
        default=None,
        metadata=_doc(
            "also write the relay URL to FILE once listening (scripts, containers)", "FILE"
        ),
    )
    log_level: str = field(
        default="info", metadata=_doc("one of " + ", ".join(LOG_LEVELS), "LEVEL")
    )
    loop: str | None = field(
        default=None,
        metadata=_doc(
            "event loop: auto (uvloop when installed), asyncio or uvloop "
            "(default: $P2PDIST_LOOP, else asyncio)",
            "LOOP",
        ),
    )
    tap: Path | None = field(
        default=None,
        metadata=_doc(
            "DEBUG: append every byte read/written on client connections (after TLS) to "
            "FILE (mode 0600; AUTH tokens blanked)",
            "FILE",
        ),
    )

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def bucket(self) -> int:
        """The rate's token bucket in bytes: ``burst``, else :data:`DEFAULT_BURST`."""
        return DEFAULT_BURST if self.burst is None else self.burst

    def effective_stun_port(self, bound_tcp_port: int) -> int:
        """The UDP port to bind for STUN (0: disabled) once the TCP port is known."""
        return bound_tcp_port if self.stun_port is None else self.stun_port

    def effective_stun_alt_port(self, stun_port: int) -> tuple[int, bool]:
        """The second observation port to bind (0: none) once the STUN port is known,
        and whether it was asked for explicitly (then failing to bind it is an error;
        the default, ``stun_port + 1``, is only tried)."""
        if self.stun_alt_port is not None:
            return (self.stun_alt_port if stun_port else 0), True
        if not stun_port or stun_port >= 65535:
            return 0, False
        return stun_port + 1, False

    def url_host(self) -> str:
        """The host name to print in the relay URL."""
        if self.public_host:
            return self.public_host
        if self.host in ("", "0.0.0.0"):
            return "127.0.0.1"
        if self.host == "::":  # an IPv6-only wildcard listener (asyncio sets V6ONLY)
            return "::1"
        return self.host


def option_names() -> list[str]:
    """Field names in declaration order (flags are these with '-' for '_')."""
    return [f.name for f in dataclasses.fields(RelayConfig)]


def _default(name: str) -> Any:
    """The default of RelayConfig's field ``name`` (a setting given as its default is
    the same as not given)."""
    return {f.name: f.default for f in dataclasses.fields(RelayConfig)}[name]


def _positive(name: str, value: float, *, allow_zero: bool = False) -> None:
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{name} must be a finite number {bound}, got {value!r}")


def _port(name: str, value: int | None) -> None:
    if value is not None and not 0 <= value <= 65535:
        raise ConfigError(f"{name} must be a port number 0..65535, got {value}")


_UNSPECIFIED = (
    "public-host {} is an address to bind, not one clients can dial: give the relay's "
    "public name or address (host is where it binds)"
)


def _dialable_name(name: str) -> None:
    """ConfigError for a public-host (without ':') that clients could never reach: an
    empty label, an unspecified address, or numbers that are no IPv4 address."""
    labels = name.removesuffix(".").split(".")
    if not all(labels):
        raise ConfigError(f"public-host {name!r} has an empty label")
    if all(label.isdigit() for label in labels):
        try:
            address = ipaddress.IPv4Address(name)
        except ValueError:
            why = "without the trailing dot" if name.endswith(".") else "as four numbers"
            raise ConfigError(f"public-host {name!r}: give an IPv4 address {why}") from None
        if address.is_unspecified:
            raise ConfigError(_UNSPECIFIED.format(name))


def _validate(c: RelayConfig) -> None:
    _port("port", c.port)
    _port("stun-port", c.stun_port)
    _port("stun-alt-port", c.stun_alt_port)
    if c.stun_alt_port:
        if c.stun_port == 0:
            raise ConfigError("stun-alt-port needs the STUN port (stun-port is 0, disabled)")
        if c.stun_alt_port == c.stun_port or (c.stun_port is None and c.stun_alt_port == c.port):
            raise ConfigError(
                f"stun-alt-port must differ from the STUN port, got {c.stun_alt_port} for both"
            )
    if c.host not in ("", "localhost"):
        try:
            ipaddress.ip_address(c.host)
        except ValueError:
            raise ConfigError(
                f"host must be an IP address to bind (or 'localhost'), got {c.host!r}; "
                "use public-host for the name in the URL"
            ) from None
    if c.public_host is not None and (
        not c.public_host
        or any(ch in c.public_host for ch in "/?# @\\")
        or not c.public_host.isprintable()
    ):
        raise ConfigError(f"public-host must be a bare host name or address, got {c.public_host!r}")
    if c.public_host is not None and ":" in c.public_host:
        inner = c.public_host.removeprefix("[").removesuffix("]")
        try:
            v6 = ipaddress.IPv6Address(inner)
        except ValueError:
            raise ConfigError(
                f"public-host {c.public_host!r} must not include a port: the URL carries "
                "the relay's own port, or public-port"
            ) from None
        if inner != c.public_host:
            raise ConfigError(f"public-host: give an IPv6 address without brackets ({inner})")
        if "%" in inner:
            raise ConfigError(f"public-host {inner!r}: clients take no IPv6 zone id")
        if v6.is_unspecified or (v6.ipv4_mapped is not None and v6.ipv4_mapped.is_unspecified):
            raise ConfigError(_UNSPECIFIED.format(inner))
    elif c.public_host is not None:
        try:  # as clients will read it from the URL: a name they refuse is no use
            dialed = ascii_host(c.public_host)
        except UsageError as exc:
            raise ConfigError(f"public-host: {exc}") from None
        _dialable_name(dialed)  # the name clients dial (IDNA maps fullwidth digits and dots)
    if c.url_file is not None and (not c.url_file.name or c.url_file.is_dir()):
        raise ConfigError(f"url-file must name a file, got {str(c.url_file)!r}")
    if c.url_file is not None and not c.url_file.parent.is_dir():
        raise ConfigError(f"url-file {str(c.url_file)!r}: no directory {str(c.url_file.parent)!r}")
    if c.public_port is not None and not 1 <= c.public_port <= 65535:
        raise ConfigError(f"public-port must be a port number 1..65535, got {c.public_port}")
    _port("http-port", c.http_port)
    if c.proxy_certs not in PROXY_CERTS:
        raise ConfigError(f"proxy-certs must be relay or own, got {c.proxy_certs!r}")
    if c.proxy_certs == "own":
        if c.http_port is None:
            raise ConfigError("proxy-certs is for the http-port: set http-port too")
        if c.public_host is None or c.public_port is None:
            raise ConfigError(
                "proxy-certs own binds proofs to the name clients dial: set public-host "
                "and public-port to the proxy's"
            )
    if c.http_port is not None:
        if c.cert is None and c.proxy_certs == "relay":
            raise ConfigError(
                "http-port needs cert and cert-key: clients sign the certificate they see, "
                "which behind a TLS-terminating proxy is the proxy's (give the relay the "
                "same files, or set proxy-certs own when the proxy has certificates of its own)"
            )
        if c.http_port and c.http_port == c.port:
            raise ConfigError(f"http-port must differ from port, got {c.port} for both")
    if not 1 <= c.proxy_hops <= MAX_PROXY_HOPS:
        raise ConfigError(f"proxy-hops must be 1..{MAX_PROXY_HOPS}, got {c.proxy_hops}")
    if c.proxy_hops != 1 and c.http_port is None:
        raise ConfigError("proxy-hops is for the http-port: set http-port too")
    if c.http_host != _default("http_host") and c.http_port is None:
        raise ConfigError("http-host is for the http-port: set http-port too")
    try:
        ipaddress.ip_address(c.http_host)
    except ValueError:
        raise ConfigError(f"http-host must be an IP address, got {c.http_host!r}") from None
    if c.cert is not None and c.key is not None:
        raise ConfigError("key (pinned mode) and cert (real certificate) exclude each other")
    if (c.cert is None) != (c.cert_key is None):
        raise ConfigError("cert and cert-key must be given together")
    if c.token is not None:
        if not c.token:
            raise ConfigError("token must not be empty (leave it unset for no token)")
        try:
            encoded = c.token.encode("utf-8")
        except UnicodeEncodeError:  # undecodable bytes from the environment or a flag
            raise ConfigError("token must be UTF-8 text") from None
        if len(encoded) > MAX_TOKEN_BYTES:
            raise ConfigError(f"token must be at most {MAX_TOKEN_BYTES} bytes")
    if c.max_clients < 1:
        raise ConfigError(f"max-clients must be >= 1, got {c.max_clients}")
    if c.max_clients_per_ip < 0:
        raise ConfigError(
            f"max-clients-per-ip must be >= 0 (0: no cap), got {c.max_clients_per_ip}"
        )
    if c.max_unauthenticated is not None and c.max_unauthenticated < 1:
        raise ConfigError(f"max-unauthenticated must be >= 1, got {c.max_unauthenticated}")
    if c.max_unauthenticated_per_ip < 1:
        raise ConfigError(
            f"max-unauthenticated-per-ip must be >= 1, got {c.max_unauthenticated_per_ip}"
        )
    _positive("rate", c.rate, allow_zero=True)
    if not c.rate and c.burst is not None:  # (given, even at the default's value)
        raise ConfigError(
            "burst is the rate's bucket and rate is 0 (unlimited, no bucket): "
            "set a rate, or leave burst out"
        )
    if c.rate and c.bucket < MAX_BODY:
        raise ConfigError(
            f"burst must be at least {MAX_BODY} bytes when rate is set, got {c.bucket}: "
            "a client may send one largest SEND at once"
        )
    _positive("burst", c.bucket)
    if c.queue_bytes < MAX_BODY + 5:
        raise ConfigError(
            f"queue-bytes must be at least {MAX_BODY + 5} (one frame), got {c.queue_bytes}"
        )
    for name in ("keepalive", "auth_timeout", "drain_timeout"):
        _positive(name.replace("_", "-"), float(getattr(c, name)))
    # The relay's timer runs at half the shortest of these: a microsecond busies a core
    # and no TLS handshake fits in it.
    for name, value in (("keepalive", c.keepalive), ("auth-timeout", c.auth_timeout)):
        if value < MIN_INTERVAL:
            raise ConfigError(f"{name} must be at least {MIN_INTERVAL:g} s, got {value!r}")
    if c.keepalive > MAX_KEEPALIVE:
        raise ConfigError(
            f"keepalive must be at most {MAX_KEEPALIVE:g} s, got {c.keepalive!r} (clients "
            f"would not take it and ping every {CLIENT_KEEPALIVE:g} s, while the relay "
            "waited 3 times as long to drop a silent one)"
        )
    _positive("retry-after", c.retry_after, allow_zero=True)
    if c.retry_after > MAX_RETRY_AFTER:
        raise ConfigError(
            f"retry-after must be at most {MAX_RETRY_AFTER:g} s, got {c.retry_after!r} "
            f"(clients take a longer one as {MAX_RETRY_AFTER:g} s)"
        )
    if c.log_level not in LOG_LEVELS:
        raise ConfigError(f"log-level must be one of {', '.join(LOG_LEVELS)}, got {c.log_level!r}")
    if c.loop is not None and c.loop not in EVENT_LOOPS:
        raise ConfigError(f"loop must be one of {', '.join(EVENT_LOOPS)}, got {c.loop!r}")


# ---- raw values -> RelayConfig --------------------------------------------------------


def _field_kind(f: dataclasses.Field[Any]) -> str:
    t = str(f.type)
    for kind in ("Path", "int", "float", "str"):
        if kind in t:
            return kind
    raise AssertionError(f"unhandled config field type {t}")  # pragma: no cover


def _coerce(
    name: str, kind: str, value: Any, base: Path | None, text: bool, *, secret: bool = False
) -> Any:
    """``value`` as ``kind``; ConfigError naming the setting, and the value given unless
    it is ``secret`` (the token: errors reach logs and journals)."""
    flag = name.replace("_", "-")
    if value is None:
        return None
    got = f"a {type(value).__name__}" if secret else repr(value)
    if kind in ("int", "float"):
        wrong = ConfigError(
            f"{flag} must be {'an integer' if kind == 'int' else 'a number'}, got {got}"
        )
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise wrong
        if (isinstance(value, str) and not text) or (kind == "int" and isinstance(value, float)):
            raise wrong  # a file's text, or 1.5 for a count
        try:
            return int(value) if kind == "int" else float(value)
        except ValueError:
            raise wrong from None
    if not isinstance(value, str | Path):
        raise ConfigError(f"{flag} must be a string, got {got}")
    if kind == "Path":
        p = Path(value).expanduser()
        return base / p if base is not None and not p.is_absolute() else p
    return str(value)


def normalize_keys(raw: Mapping[str, Any], source: str) -> dict[str, Any]:
    """Map ``max-clients`` / ``max_clients`` keys to field names; unknown keys are errors."""
    known = set(option_names())
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in known:
            valid = ", ".join(n.replace("_", "-") for n in option_names())
            raise ConfigError(f"{source}: unknown setting {key!r} (valid: {valid})")
        if name in out:
            raise ConfigError(f"{source}: {key!r} is given twice")
        out[name] = value
    return out


def coerce(
    values: Mapping[str, Any], *, base: Path | None = None, text: bool = True
) -> dict[str, Any]:
    """Typed values from raw ones keyed by field name; ``base`` resolves relative paths.
    ``text``: numbers may be strings, as they come from flags or the environment (a
    TOML file's are typed: ``port = "8443"`` is an error there)."""
    fields = {f.name: f for f in dataclasses.fields(RelayConfig)}
    return {
        name: _coerce(
            name, _field_kind(fields[name]), value, base, text, secret=not fields[name].repr
        )
        for name, value in values.items()
    }


def from_mapping(values: Mapping[str, Any], *, base: Path | None = None) -> RelayConfig:
    """Build and validate a config from raw values keyed by field name."""
    return RelayConfig(**coerce(values, base=base))
