"""The NAT lab (tests/natlab.py) behaves as it claims, shown with a real relay process
and plain UDP sockets in the lab's namespaces: the mapping each NAT kind gives (seen
through the relay's two observation ports), the filtering of unsolicited packets, a
manual hole punch that works for eim-eim and fails for symmetric-symmetric, IPv6 behind
stateful firewalls (no NAT; punching works whatever the IPv4 NAT), runtime UDP blocking,
conntrack expiry, and a teardown that leaves nothing behind."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator

import pytest
from natlab import (
    KINDS,
    PREFIX,
    NatLab,
    UdpAgent,
    _run,
    leftover_namespaces,
    require_ipv6,
    require_root,
)

Addr = tuple[str, int]


@pytest.fixture
def make_lab() -> Iterator[Callable[..., NatLab]]:
    """Build labs (skipping when the lab cannot run here); all torn down at the end."""
    require_root()
    with contextlib.ExitStack() as stack:
        yield lambda *kinds, **kw: stack.enter_context(NatLab(*kinds, **kw))


def with_relay(lab: NatLab) -> NatLab:
    lab.spawn_relay("--stun-port", "3478")  # alternate port: the default, 3479
    assert lab.stun_ports == (3478, 3479)
    return lab


def mapped_once(agent: UdpAgent, lab: NatLab) -> Addr:
    """The agent's public mapping as the relay's STUN port sees it."""
    m = agent.stun(lab.relay_ip, lab.stun_ports[:1], timeout=5.0)[0]
    assert m is not None
    return m


def arrivals(agent: UdpAgent, timeout: float = 0.5) -> list[str]:
    """Every datagram but punch packets that arrives within ``timeout`` s (a slow
    machine only makes a check for "nothing arrives" pass more easily)."""
    out: list[str] = []
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        got = agent.recv(left)
        if got is not None and got[1] != "punch":
            out.append(got[1])
    return out


def received(agent: UdpAgent, data: str, timeout: float = 5.0) -> Addr | None:
    """The source of ``data`` if it arrives within ``timeout`` s (other datagrams, such
    as the tail of a punch, are skipped)."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        got = agent.recv(left)
        if got is None:
            return None
        if got[1] == data:
            return got[0]
    return None


# ---- mapping: one local socket, two relay ports -----------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_observation_ports_show_each_kinds_mapping(
    make_lab: Callable[..., NatLab], kind: str
) -> None:
    lab = with_relay(make_lab(kind, "none"))
    a = lab.udp_agent("a")
    # Answers come within milliseconds; the bound only matters for udp-blocked.
    first, second = a.stun(lab.relay_ip, lab.stun_ports, timeout=1.0 if "blocked" in kind else 5.0)
    if kind == "none":  # the host's own public address, unchanged
        assert first == second == (lab.public_ip("a"), a.local[1])
        assert a.local[0] == lab.public_ip("a")
    elif kind == "eim":  # the router's WAN address, one port for every destination
        assert first is not None and second is not None
        assert first[0] == second[0] == lab.public_ip("a") and first[1] == second[1]
        assert a.local[0] == lab.lan_host_ip
    elif kind == "symmetric":  # a new public port per destination
        assert first is not None and second is not None
        assert first[0] == second[0] == lab.public_ip("a") and first[1] != second[1]
    else:  # udp-blocked: no answer at all, but TCP to the relay still works
        assert (first, second) == (None, None)
        assert a.tcp(lab.relay_ip, lab.relay_port) is None
        b = lab.udp_agent("b")  # the relay itself answers; the router is the block
        assert (
            b.stun(lab.relay_ip, lab.stun_ports, timeout=5.0)
            == [(lab.public_ip("b"), b.local[1])] * 2
        )


# ---- filtering ------------------------------------------------------------------------


def test_eim_router_drops_unsolicited_udp_and_filters_by_address_and_port(
    make_lab: Callable[..., NatLab],
) -> None:
    lab = with_relay(make_lab("eim", "none"))
    a, b, internet = lab.udp_agent("a"), lab.udp_agent("b"), lab.udp_agent("internet")
    m = mapped_once(a, lab)  # the mapping exists now (towards the relay's STUN port)
    internet.send(m, "from the relay's address, another port")
    b.send(m, "unsolicited")
    assert arrivals(a) == []
    a.send(b.local, "hello b")  # a opens its side towards b's exact address...
    assert received(b, "hello b") == m  # ...from the same public mapping (EIM)
    b.send(m, "reply")
    assert received(a, "reply") == b.local  # ...and now b's packets are let in
    internet.send(m, "still filtered")
    assert arrivals(a) == []


# ---- hole punching with plain sockets -----------------------------------------------------


@pytest.mark.parametrize(
    ("kind_a", "kind_b", "works"),
    [
        ("eim", "eim", True),
        ("none", "eim", True),
        ("eim", "symmetric", False),
        ("symmetric", "symmetric", False),
    ],
)
def test_manual_hole_punch(
    make_lab: Callable[..., NatLab], kind_a: str, kind_b: str, works: bool
) -> None:
    lab = with_relay(make_lab(kind_a, kind_b))
    a, b = lab.udp_agent("a"), lab.udp_agent("b")
    ma, mb = mapped_once(a, lab), mapped_once(b, lab)  # what each would tell the other
    bounds = a.punch_begin(mb, 1.5), b.punch_begin(ma, 1.5)
    heard_a, heard_b = a.finish(bounds[0])["heard"], b.finish(bounds[1])["heard"]
    if works:
        assert heard_a is not None and heard_b is not None
        a.send(mb, "direct")
        assert received(b, "direct") == ma
    else:
        assert heard_a is None and heard_b is None
        a.send(mb, "direct")
        assert arrivals(b) == []


@pytest.mark.parametrize(("kind_a", "kind_b"), [("symmetric", "symmetric"), ("none", "eim")])
def test_ipv6_firewall_drops_unsolicited_udp_and_lets_a_punch_through(
    make_lab: Callable[..., NatLab], kind_a: str, kind_b: str
) -> None:
    """IPv6 hosts keep their own addresses (no NAT, whatever the IPv4 side does) behind
    stateful firewalls: unsolicited UDP is dropped, and both sides sending opens the path,
    also where the IPv4 NATs are symmetric and no IPv4 punch can work."""
    require_ipv6()
    lab = make_lab(kind_a, kind_b, ipv6=True)
    a, b = lab.udp_agent("a", ipv6=True), lab.udp_agent("b", ipv6=True)
    assert a.local[0] == lab.host_ip6("a") and b.local[0] == lab.host_ip6("b")
    if kind_b != "none":  # a router's firewall in front of b
        a.send(b.local, "unsolicited")
        assert arrivals(b) == []
    bounds = a.punch_begin(b.local, 3.0), b.punch_begin(a.local, 3.0)
    heard_a, heard_b = a.finish(bounds[0])["heard"], b.finish(bounds[1])["heard"]
    assert heard_a is not None and heard_b is not None
    a.send(b.local, "direct")
    assert received(b, "direct") == a.local  # its own address: nothing translated it
    if kind_b != "none":  # the hole is for a's address and port only
        internet = lab.udp_agent("internet", ipv6=True)
        internet.send(b.local, "still filtered")
        assert arrivals(b) == []


def test_block_udp_at_runtime_and_mapping_expiry(make_lab: Callable[..., NatLab]) -> None:
    lab = with_relay(make_lab("eim", "eim", udp_timeout=2))
    a, b = lab.udp_agent("a"), lab.udp_agent("b")
    ma, mb = mapped_once(a, lab), mapped_once(b, lab)
    bounds = a.punch_begin(mb, 1.5), b.punch_begin(ma, 1.5)
    assert a.finish(bounds[0])["heard"] is not None and b.finish(bounds[1])["heard"] is not None
    lab.block_udp("a")  # an established direct path dies
    b.send(ma, "blocked")
    assert arrivals(a) == []
    lab.unblock_udp("a")
    a.send(mb, "keepalive")  # traffic refreshes the mapping
    b.send(ma, "back")
    assert received(a, "back") == mb
    time.sleep(3.0)  # silence beyond the 2 s conntrack timeout: the mapping is gone
    b.send(ma, "expired")
    assert arrivals(a) == []


# ---- lifecycle -----------------------------------------------------------------------------


def test_teardown_on_exception_and_stale_cleanup() -> None:
    require_root()
    stale = f"{PREFIX}999999999-0-inet"  # above pid_max: a run that cannot be alive
    _run(["ip", "netns", "add", stale])
    with pytest.raises(RuntimeError, match="boom"), NatLab("eim", "symmetric") as lab:
        assert stale not in leftover_namespaces()
        assert len(leftover_namespaces(lab.prefix)) == 5  # internet, 2 routers, 2 hosts
        sleeper = lab.spawn("a", [sys.executable, "-c", "import time; time.sleep(60)"])
        raise RuntimeError("boom")
    assert leftover_namespaces(lab.prefix) == []
    assert sleeper.poll() is not None
    with NatLab("none", "none") as lab:
        assert len(leftover_namespaces(lab.prefix)) == 3  # no routers
        assert lab.router_ns("a") is None and lab.host_ip("a") == lab.public_ip("a")
    assert leftover_namespaces(lab.prefix) == []
