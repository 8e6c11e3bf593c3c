"""``p2pdist doctor``: what this host's network lets p2pdist do, in one command.

``p2pdist doctor --relay URL`` connects to the relay and reports: whether the session
comes up and its round-trip time; whether UDP gets out (the relay's observation ports
answer a STUN Binding Request); the address(es) they see; and, from one local socket
to two observation ports, the NAT's mapping behaviour: *none (public address)* (both
saw the socket's own address), *endpoint-independent* (the same
public port towards every destination, so hole punching works with most peers) or
*endpoint-dependent* ("symmetric": a new port per destination, so only peers without
NAT are reached directly and the rest stays on the relay).

``--peer ID`` also dials that endpoint through the relay, waits for hole punching to
find a direct path (bounded by ``--timeout``), and reports how long it took, the
path's RTT and a one-way transfer rate. The other end runs ``p2pdist doctor --relay URL
--serve``, which prints its endpoint id and answers doctors until interrupted.
``--json`` prints one JSON object instead of the readable report.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import math
import sys
import time
from dataclasses import dataclass, field

from . import eventloop
from .errors import (
    P2PError,
    P2PTimeoutError,
    PeerAuthenticationError,
    PeerError,
    UsageError,
)
from .identity import EndpointId, SecretKey
from .settings import env_token
from .transport.base import Connection, TransportConfig
from .transport.interfaces import interface_addresses, interface_addresses6
from .transport.observe import StunProbe, mapping_behaviour
from .transport.pathinfo import LossInfo
from .transport.paths import UdpAddress, UdpSocket, bind_host_for, is_loopback, path_key
from .transport.quic import QuicTransport
from .transport.relay_path import RelayPath
from .wire.probe import DatagramKind, classify

__all__ = ["DoctorReport", "PeerReport", "diagnose", "main", "serve"]

DATA_CHANNEL = 1
ACK_CHANNEL = 2
TRANSFER_BYTES = 8 << 20


@dataclass(slots=True)
class PeerReport:
    """What ``--peer`` found out."""

    peer: str
    connected: bool = False
    error: str | None = None
    direct: bool = False
    direct_after: float | None = None
    """Seconds from the dial (through the relay) to a validated direct path."""
    remote: str | None = None
    rtt: float | None = None
    """QUIC's smoothed RTT on the final path, seconds."""
    transfer_mb_s: float | None = None
    """One-way rate of an 8 MiB message on the final path, MB/s."""
    loss: LossInfo | None = None
    """The final path's congestion controller and the losses during the check."""
    punching: str | None = None
    last_failure: str | None = None


@dataclass(slots=True)
class DoctorReport:
    """Everything ``p2pdist doctor`` measured."""

    relay: str
    endpoint: str
    relay_connected: bool = False
    """The relay's session came up and it answered a PING."""
    relay_reached: bool = False
    """The relay's session came up (it may have stopped answering then: ``relay_error``)."""
    relay_error: str | None = None
    relay_refused: bool = False
    """The relay answered, and its allowlist refused this key."""
    relay_denied: bool = False
    """The relay answered and refused this client (a bad or missing token, its
    allowlist), or its key is not the URL's pin (we refused it), or the HTTP proxy on
    the way refused the tunnel (the relay was not reached): see ``relay_error``."""
    relay_refusal: str | None = None
    """Which, when :attr:`relay_denied` (``RelayStatus.refusal``: ``"not_allowed"``,
    ``"bad_token"``, ``"pin_mismatch"``, ``"proxy_refused"``...)."""
    fresh_key: bool = False
    """The key was made for this run (no ``--key``): another run has another id."""
    relay_rtt: float | None = None
    """Seconds, PING/PONG over the relay session (TCP + TLS)."""
    relay_sees: str | None = None
    """Our TCP address as the relay sees it."""
    relay_records: str | None = None
    """The record protection after the upgrade ("aes-256-gcm"), None when TLS carries it."""
    relay_framing: str | None = None
    """``"websocket"`` when the session's frames travel in WebSocket frames (a relay
    behind a TLS-terminating reverse proxy), ``"raw"`` otherwise."""
    relay_proof: str | None = None
    """What our AUTH proof was bound to: ``"certificate"``, or ``"name"`` (a relay behind a
    proxy with certificates of its own)."""
    relay_proxy: str | None = None
    """The HTTP proxy the relay session is tunnelled through (P2PDIST_RELAY_PROXY), if any."""
    local: str | None = None
    """The local UDP socket the observations were made from."""
    interfaces: list[str] = field(default_factory=list)
    """This host's interface addresses (IPv4, then global IPv6), loopback left out."""
    observation_ports: list[int] = field(default_factory=list)
    observation_ipv6: list[bool] = field(default_factory=list)
    """For each of :attr:`observation_ports`: whether it was asked over IPv6."""
    observed: list[str] = field(default_factory=list)
    """Our UDP address as each observation port saw it (in port order; IPv4 first, then
    IPv6 where the relay's name has both)."""
    udp: bool = False
    """Whether any observation port answered (UDP gets out and back)."""
    observation_off: bool = False
    """The relay runs no observation port (``--stun-port 0``): UDP was not checked."""
    mapping: str = "unknown"
    """``endpoint-independent``, ``endpoint-dependent``, ``none (public address)``,
    ``no UDP`` or ``unknown`` (IPv4, or IPv6 for a relay reached over IPv6 only)."""
    mapping6: str | None = None
    """The IPv6 mapping, where the relay was asked over both families."""
    peer: PeerReport | None = None

    def verdict(self) -> str:
        """One line: what to expect for direct paths from this host (and, when the
        check of a peer failed, that it did)."""
        host = self._host_verdict()
        p = self.peer
        if p is not None and (not p.connected or p.error):
            return f"{host}; but the check of peer {p.peer[:10]} failed (above)"
        return host

    def _host_verdict(self) -> str:
        if self.relay_refused:
            if self.fresh_key:  # its id is gone with this run: allowing it helps no one
                return (
                    "the relay's allowlist refuses this key, made for this run only: "
                    "pass --key with a key file the allowlist holds (`p2pdist keygen --out "
                    "node.key`, then add the line of `p2pdist id node.key --allowlist`)"
                )
            return (
                "the relay's allowlist refuses this key: nothing works until it lets it "
                "in (add this endpoint id to the allowlist, or pass --key with an allowed "
                "key file; `p2pdist keygen` makes one)"
            )
        if self.relay_refusal == "pin_mismatch":
            # We refused it: whoever answers there is not the relay the URL pins.
            return (
                "the relay presented another key than the URL's pin: check the URL (a "
                "relay restarted without --key has a new pin), or suspect interception"
            )
        if self.relay_refusal == "proxy_refused":
            return (
                "the HTTP proxy refuses the tunnel to the relay (above: 407 asks for "
                "credentials, 403 forbids it): fix the proxy URL or its user:password "
                "($P2PDIST_RELAY_PROXY, relay_proxy=)"
            )
        if self.relay_denied:
            return "the relay refuses this client (above): nothing works until it lets it in"
        if self.relay_reached and not self.relay_connected:
            return (
                "the relay stopped answering once its session was up (overloaded, "
                "restarting, or a proxy cut the connection): nothing was tested beyond it"
            )
        if not self.relay_connected:
            return "cannot reach the relay: nothing works until it can"
        if self.relay_error is not None:
            return f"the relay answers, but {self.relay_error}: nothing was tested beyond it"
        if self.observation_off:
            return (
                "the relay observes no UDP addresses (--stun-port 0): direct paths only "
                "between peers that reach each other's own addresses, the rest stay relayed"
            )
        if not self.udp:
            return "UDP is blocked: every peer is reached through the relay (TCP + TLS)"
        punchable6 = ("endpoint-independent", "none (public address)")
        if self.mapping == "no UDP" and self.mapping6 is not None:  # UDP over IPv6 only
            return f"UDP over IPv4 is blocked; over IPv6: {_mapping_verdict(self.mapping6)}"
        if self.mapping == "endpoint-dependent":
            if self.mapping6 == "endpoint-dependent":
                return "symmetric NAT on IPv4 and IPv6: direct paths only to peers without NAT"
            if self.mapping6 in punchable6 or (
                self.mapping6 is None and any(":" in a for a in self.interfaces)
            ):
                return (
                    "symmetric NAT: over IPv4, direct paths only to peers without NAT; "
                    "this host has global IPv6, so peers with IPv6 may still go direct"
                )
        return _mapping_verdict(self.mapping)


def _mapping_verdict(mapping: str) -> str:
    """What a NAT mapping behaviour means for direct paths (UDP gets through)."""
    if mapping == "endpoint-dependent":
        return "symmetric NAT: direct paths only to peers without NAT, the rest stay relayed"
    if mapping == "endpoint-independent":
        return "hole punching should work with most peers (relay as the fallback)"
    if mapping == "none (public address)":
        return "no NAT: peers that can send to this address reach it directly"
    if mapping == "no UDP":
        return "UDP is blocked: every peer is reached through the relay (TCP + TLS)"
    return "UDP works; the mapping type is unknown (the relay has one observation port)"


async def _observe(
    targets: list[UdpAddress], timeout: float, interfaces: list[str]
) -> tuple[str, set[str], list[tuple[UdpAddress, str | None]]]:
    """Binding Requests from one new socket to every target it can reach: (its local
    address, its own addresses on ``interfaces``, [(target, seen or None)])."""

    def on_datagram(sock: UdpSocket, data: bytes, addr: UdpAddress) -> None:
        if classify(data) is DatagramKind.STUN:
            probe.on_datagram(data)

    host = bind_host_for(targets)
    if host is None:
        sock = await UdpSocket.open_any(0, on_datagram)
    else:
        sock = await UdpSocket.open(host, 0, on_datagram)
    try:
        targets = [t for t in targets if sock.reaches(t)]
        probe = StunProbe(targets)
        answers = await probe.run(sock.send, timeout)
        local = path_key(sock.local_address)
        port = sock.local_address[1]
    finally:
        sock.close()
    own = {local, *(path_key((ip, port)) for ip in interfaces)}
    return (
        local,
        own,
        [
            (t, path_key(a) if a is not None else None)
            for t, a in zip(targets, answers, strict=True)
        ],
    )


async def diagnose(
    relay: str,
    *,
    key: SecretKey | None = None,
    peer: EndpointId | None = None,
    token: str | None = None,
    timeout: float = 10.0,
) -> DoctorReport:
    """Run every check (see the module docstring); never raises for network trouble,
    the report says what failed (UsageError for a ``peer`` that is our own id)."""
    fresh = key is None
    key = key or SecretKey.generate()
    if peer is not None and peer == key.endpoint_id:
        raise UsageError(
            f"--peer {peer.short()} is this doctor's own endpoint id "
            "(the same --key on both hosts?)"
        )
    path = RelayPath(key, relay, token=token)
    report = DoctorReport(str(path.url), str(key.endpoint_id), fresh_key=fresh)
    report.interfaces = [a for a in interface_addresses() if not is_loopback(a)]
    report.interfaces += interface_addresses6()  # candidates too (the group's socket is dual-stack)
    transport = QuicTransport(key, TransportConfig(handshake_timeout=timeout), relay=path)
    try:
        try:
            await path.wait_connected(timeout)
            report.relay_reached = True
            report.relay_rtt = await path.ping(timeout)
            report.relay_connected = True  # (only once it answers: then UDP is tested)
        except P2PError as exc:
            # The report's line names the relay already: keep only what went wrong.
            text = exc.detail if isinstance(exc, PeerError) else str(exc)
            report.relay_error = text.removeprefix(f"relay {path.url}: ")
            report.relay_denied = path.status.refused
            report.relay_refusal = path.status.refusal
            report.relay_refused = path.status.refusal == "not_allowed"
            return report
        report.relay_sees = path.status.observed
        report.relay_records = path.status.records
        report.relay_framing = path.status.framing
        report.relay_proof = path.status.proof
        report.relay_proxy = path.status.proxy
        targets = await path.observation_targets()
        if path.observation_off:
            report.observation_off = True
        elif not targets:
            report.relay_error = f"cannot resolve {path.url.host}"
            return report
        if targets:
            local, own, seen = await _observe(targets, min(timeout, 3.0), report.interfaces)
            report.local = local
            report.observation_ports = [port for (_, port), _ in seen]
            report.observation_ipv6 = [":" in host for (host, _), _ in seen]
            report.observed = [a or "no answer" for _, a in seen]
            report.udp = any(a is not None for _, a in seen)
            v4 = [a for (host, _), a in seen if ":" not in host]
            v6 = [a for (host, _), a in seen if ":" in host]
            report.mapping = mapping_behaviour(v4 or v6, own)
            if v4 and v6:
                report.mapping6 = mapping_behaviour(v6, own)
        if peer is not None:
            report.peer = await _check_peer(transport, peer, timeout)
        return report
    finally:
        await transport.close()


async def _check_peer(transport: QuicTransport, peer: EndpointId, timeout: float) -> PeerReport:
    out = PeerReport(str(peer))
    # Punching starts as soon as the relayed handshake has authenticated the peer, often
    # before connect() returns: time the direct path from the dial.
    start = time.monotonic()
    try:
        conn = await transport.connect(peer, None, label=f"peer {peer.short()}")
    except P2PError as exc:
        out.error = str(exc)
        return out
    out.connected = True
    give_up = time.monotonic() + timeout  # punching gets its own timeout after the dial
    while True:
        if conn.path_kind == "direct":
            out.direct = True
            out.direct_after = time.monotonic() - start
            break
        if time.monotonic() >= give_up:
            break
        await asyncio.sleep(0.002)
    try:
        payload = bytes(TRANSFER_BYTES)
        t0 = time.perf_counter()
        await conn.send(DATA_CHANNEL, payload)
        await conn.recv(ACK_CHANNEL, timeout=max(timeout, 30.0))
        out.transfer_mb_s = TRANSFER_BYTES / (time.perf_counter() - t0) / 1e6
    except P2PError as exc:
        out.error = f"transfer failed: {exc}"
    info = transport.paths().get(peer)
    if info is not None:
        out.remote, out.rtt = info.remote, info.rtt
        out.punching, out.last_failure = info.punching, info.last_failure
        out.loss = info.loss
    await conn.close()
    return out


async def serve(
    relay: str,
    *,
    key: SecretKey | None = None,
    token: str | None = None,
    ready: asyncio.Event | None = None,
    timeout: float = 10.0,
    as_json: bool = False,
) -> None:
    """Answer doctors that dial us through ``relay`` (forever; cancel to stop); the first
    session to the relay must come up within ``timeout`` seconds. Once it has, prints
    ``doctor serving as ID`` (``as_json``: the line ``{"serving": "ID"}``)."""
    key = key or SecretKey.generate()
    path = RelayPath(key, relay, token=token)
    transport = QuicTransport(key, relay=path)
    try:
        await path.wait_connected(timeout)
        if as_json:
            print(json.dumps({"serving": str(key.endpoint_id)}), flush=True)
        else:
            print(f"doctor serving as {key.endpoint_id}", flush=True)
        if ready is not None:
            ready.set()
        tasks: set[asyncio.Task[None]] = set()
        while True:
            conn = await transport.accept()
            task = asyncio.create_task(_answer(conn))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
    finally:
        await transport.close()


async def _answer(conn: Connection) -> None:
    try:
        while True:
            frame = await conn.recv(DATA_CHANNEL, timeout=120.0)
            await conn.send(ACK_CHANNEL, len(frame.payload).to_bytes(8, "big"))
    except P2PError:
        pass
    finally:
        await conn.close()


def _ms(seconds: float | None) -> str:
    return "?" if seconds is None else f"{seconds * 1000:.1f} ms"


def render(r: DoctorReport) -> str:
    """The readable report."""
    # The whole id where the relay refused it: the one to put on an allowlist.
    lines = [f"p2pdist doctor (as {r.endpoint if r.relay_refused else r.endpoint[:10]})"]
    if r.relay_reached and not r.relay_connected:
        lines.append(f"  relay        {r.relay}: STOPPED ANSWERING ({r.relay_error})")
    elif not r.relay_connected:
        lines.append(f"  relay        {r.relay}: NOT CONNECTED ({r.relay_error})")
    else:
        lines.append(f"  relay        {r.relay}")
        link = "TLS, then " + r.relay_records + " records" if r.relay_records else "TLS"
        if r.relay_framing == "websocket":
            link += ", WebSocket frames"
        if r.relay_proof == "name":
            link += ", proof bound to the relay's name"
        if r.relay_proxy:
            link += f", through proxy {r.relay_proxy}"
        lines.append(
            f"               connected ({link}), RTT {_ms(r.relay_rtt)}, sees us at {r.relay_sees}"
        )
        ipv6 = r.observation_ipv6 or [False] * len(r.observation_ports)
        seen_by = zip(r.observation_ports, ipv6, r.observed, strict=False)
        pairs = ", ".join(
            f"{seen} ({'IPv6 ' if v6 else ''}port {port})" for port, v6, seen in seen_by
        )
        if r.observation_off:
            lines.append("  UDP          not checked: the relay has address observation off")
        else:
            lines.append(f"  UDP          {'reachable' if r.udp else 'BLOCKED'}: {pairs}")
        local = r.local or "not checked"
        lines.append(f"  local        {local} (interfaces: {', '.join(r.interfaces) or '-'})")
        ipv6_mapping = f" (IPv6: {r.mapping6})" if r.mapping6 is not None else ""
        lines.append(f"  NAT mapping  {r.mapping}{ipv6_mapping}")
    p = r.peer
    if p is not None:
        if not p.connected:
            lines.append(f"  peer         {p.peer[:10]}: NOT CONNECTED ({p.error})")
        elif p.direct:
            lines.append(
                f"  peer         {p.peer[:10]}: direct path after {_ms(p.direct_after)} "
                f"to {p.remote}, RTT {_ms(p.rtt)}"
            )
        else:
            why = f" ({p.last_failure})" if p.last_failure else ""
            lines.append(
                f"  peer         {p.peer[:10]}: NO direct path, relayed{why}, RTT {_ms(p.rtt)}"
            )
        if p.transfer_mb_s is not None:
            lines.append(f"               8 MiB one way: {p.transfer_mb_s:.1f} MB/s{_loss(p)}")
        elif p.connected and p.error:
            lines.append(f"               {p.error}")
    lines.append(f"  verdict      {r.verdict()}")
    return "\n".join(lines)


def _loss(p: PeerReport) -> str:
    """`` (bbr, 12 packets lost, 3 of them late: the path reorders)``, or nothing."""
    loss = p.loss
    if loss is None:
        return ""
    text = f"{loss.congestion_control}, {loss.packets_lost} packets lost"
    if loss.spurious_losses:
        text += f", {loss.spurious_losses} of them late"
    if loss.reordering:
        text += ": the path reorders"
    return f" ({text})"


def main(argv: list[str]) -> int:
    """``p2pdist doctor``: exit 0 when the relay is reachable (and the peer, if asked),
    1 otherwise; 2 for bad arguments or a key file that cannot be used, 130 when
    interrupted."""
    ap = argparse.ArgumentParser(
        prog="p2pdist doctor", description=__doc__.split("\n\n")[0].replace("``", "")
    )
    ap.add_argument("--relay", required=True, help="relay URL, as p2pdist-relay prints it")
    ap.add_argument("--peer", help="endpoint id of a peer running `p2pdist doctor --serve`")
    ap.add_argument("--serve", action="store_true", help="answer other doctors (until ^C)")
    ap.add_argument("--key", help="key file to use (default: a fresh key)")
    ap.add_argument(
        "--token",
        help="relay access token (default: $P2PDIST_RELAY_TOKEN, as the relay reads it)",
    )
    ap.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        help=(
            "bound per check, seconds (default 10; the 8 MiB transfer to --peer waits at "
            "least 30 s, for slow links; --serve: on reaching the relay)"
        ),
    )
    ap.add_argument(
        "--json",
        action="store_true",
        help='print one JSON object (--serve: the line {"serving": ID} once it serves)',
    )
    args = ap.parse_args(argv)
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        ap.error(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
    if args.serve and args.peer:
        ap.error("--serve answers other doctors; --peer dials one: pass one of them")
    if args.token == "":  # as an empty $P2PDIST_RELAY_TOKEN, not "no token" in silence
        ap.error("--token is empty: leave it out for no token")
    try:
        if args.token is None:
            args.token = env_token()
        key = SecretKey.load(args.key) if args.key else None
        if args.serve:
            serving = serve(
                args.relay, key=key, token=args.token, timeout=args.timeout, as_json=args.json
            )
            try:
                eventloop.run(serving)
            except (P2PTimeoutError, PeerAuthenticationError) as exc:  # as the report's 1
                print(f"p2pdist doctor: {exc}", file=sys.stderr)
                return 1
            return 0
        peer = EndpointId.parse(args.peer) if args.peer else None
        # What goes wrong is the report's to say (a relay's refusal was printed twice:
        # as the library's warning, then in the report).
        logging.getLogger("p2pdist").setLevel(logging.ERROR)
        report = eventloop.run(
            diagnose(args.relay, key=key, peer=peer, token=args.token, timeout=args.timeout)
        )
    except UsageError as exc:
        ap.error(str(exc))
    except P2PError as exc:
        print(f"p2pdist doctor: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    if args.json:
        print(json.dumps(dataclasses.asdict(report), indent=2))
    else:
        print(render(report))
    ok = (
        report.relay_connected
        and report.relay_error is None
        and (report.peer is None or (report.peer.connected and report.peer.error is None))
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
