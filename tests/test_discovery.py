"""Groups formed with neither peers= nor relay=: the ranks find each other on the local
network by mDNS (p2pdist/discovery.py). The network tests run inside namespaces they
build (a LAN of namespaces, or one namespace's loopback), as root; elsewhere they skip,
saying why."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
from natlab import PREFIX, Lan, require_root
from zeroconf import NonUniqueNameException

from p2pdist import Group, UsageError
from p2pdist.discovery import LanDiscovery, dial_order
from p2pdist.errors import ConnectionBrokenError
from p2pdist.identity import SecretKey

WORKER = Path(__file__).with_name("discovery_worker.py")
ROOT = Path(__file__).resolve().parent.parent
SEED = "a long shared secret seed for discovery"


def _net(cidr: str) -> tuple[str, ipaddress.IPv4Network]:
    return cidr.split("/")[0], ipaddress.IPv4Network(cidr, strict=False)


def test_the_dial_order_puts_a_shared_network_first_and_leaves_this_hosts_own_out() -> None:
    ours = [_net("172.17.0.1/16"), _net("10.77.0.2/24"), _net("127.0.0.1/8")]
    # a docker bridge's address, the same on every host: dialed there, it reaches us (it
    # came last; raced with the others, it could win over a slow answer of the right one)
    assert dial_order(["172.17.0.1", "10.77.0.5"], ours) == ["10.77.0.5"]
    assert dial_order(["192.168.9.9", "10.77.0.5"], ours) == ["10.77.0.5", "192.168.9.9"]
    # a rank on this very host announces only our addresses, all of which reach it
    assert dial_order(["172.17.0.1", "10.77.0.2"], ours) == ["172.17.0.1", "10.77.0.2"]


def test_discovery_needs_an_ipv4_listen_address() -> None:
    me = SecretKey.generate().endpoint_id
    for host in ("::", "::1", "example.org"):
        with pytest.raises(UsageError, match="IPv4"):
            LanDiscovery(me, host, 1234, "rank 0")


def _start(
    prefix: list[str], *argv: str, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*prefix, sys.executable, str(WORKER), *argv],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _results(procs: list[subprocess.Popen[str]]) -> list[dict[str, Any]]:
    """Each worker's JSON line (bounded wait; killed after)."""
    outs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=150)
            lines = [line for line in out.splitlines() if line.startswith("{")]
            assert lines, f"rank printed nothing (rc {proc.returncode}): {err[-3000:]}"
            outs.append(json.loads(lines[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return outs


def test_ranks_on_one_lan_find_each_other_without_peers_or_relay() -> None:
    """Three hosts on one switch, each rank with ``Group.from_seed(seed, rank=r,
    world=3)`` and nothing else: the group forms, the all_reduce is right, and each rank
    dialed the others at their LAN addresses. Every host also has the same docker-like
    bridge address (172.17.0.1/16, listed before the LAN's, so announced first), and host
    0 one no other host reaches: dialed, they lead nowhere (a reviewer saw a rank dial its
    own bridge and never form). Which of them are dialed is dial_order's, tested on its
    own above (this host's own are left out), so this test shows only that the group
    forms over the LAN all the same."""
    require_root()
    with Lan(3) as lan:
        for r in range(3):
            for cidr in ("172.17.0.1/16", "172.31.9.1/32")[: 2 if r == 0 else 1]:
                add = ["ip", "-n", lan.host_ns(r), "addr", "add", cidr, "dev", "lo"]
                subprocess.run(add, check=True)
        procs = [_start(lan.exec_prefix(r), SEED, str(r), "3") for r in range(3)]
        for r, out in enumerate(_results(procs)):
            assert out.get("sum") == [6.0] * 4, (r, out)
            for p, address in out["dialed"].items():
                assert str(address).startswith(f"{lan.ip(int(p))}:"), (r, out)


def test_an_announced_address_that_drops_what_it_is_sent_does_not_hold_the_dial() -> None:
    """Rank 0's host announces first an address on a network the dialer shares but whose
    packets the dialer's firewall drops (a VPN's, say): the addresses are raced, so the
    dial does not wait there for the whole handshake_timeout (30 s here, more than this
    run's 20 s connect_timeout: room for a loaded machine), and the group forms over
    the LAN, at the address that answered."""
    require_root()
    with Lan(2) as lan:
        ns0, ns1 = lan.host_ns(0), lan.host_ns(1)
        # The first address of the first interface (lo's, before 127.0.0.1): announced first.
        lo0 = ["ip", "-n", ns0, "addr"]
        subprocess.run([*lo0, "del", "127.0.0.1/8", "dev", "lo"], check=True)
        subprocess.run([*lo0, "add", "10.99.0.1/24", "dev", "lo"], check=True)
        subprocess.run([*lo0, "add", "127.0.0.1/8", "dev", "lo"], check=True)
        subprocess.run(["ip", "-n", ns1, "addr", "add", "10.99.0.2/24", "dev", "lo"], check=True)
        drop = ["iptables", "-A", "OUTPUT", "-d", "10.99.0.1", "-j", "DROP"]
        subprocess.run(["ip", "netns", "exec", ns1, *drop], check=True)
        argv = (SEED, "2", "", "20", "30")
        procs = [_start(lan.exec_prefix(r), argv[0], str(r), *argv[1:]) for r in range(2)]
        outs = _results(procs)
        assert [out.get("sum") for out in outs] == [[3.0] * 4] * 2, outs
        assert str(outs[1]["dialed"]["0"]).startswith(f"{lan.ip(0)}:"), outs[1]


@pytest.fixture
def loopback_namespace() -> Iterator[Lan]:
    """A namespace of its own (mDNS on its loopback, 127.0.0.1)."""
    require_root()
    with Lan(1) as lan:
        yield lan


def test_ranks_on_one_host_find_each_other_over_loopback(loopback_namespace: Lan) -> None:
    """listen="127.0.0.1:0" keeps mDNS on loopback: ranks of one host only."""
    prefix = loopback_namespace.exec_prefix(0)
    procs = [_start(prefix, SEED, str(r), "2", "127.0.0.1:0") for r in range(2)]
    for out in _results(procs):
        assert out.get("sum") == [3.0] * 4, out
        assert all(str(a).startswith("127.0.0.1:") for a in out["dialed"].values()), out


def test_from_env_with_p2pdist_lan_finds_the_ranks(loopback_namespace: Lan) -> None:
    """``Group.from_env()`` with P2PDIST_LAN=1 in place of P2PDIST_PEERS or P2PDIST_RELAY,
    and P2PDIST_LISTEN as its listen address: the ranks find each other as with
    from_seed and nothing else."""
    prefix = loopback_namespace.exec_prefix(0)
    base = {k: v for k, v in os.environ.items() if not k.startswith("P2PDIST_")}
    base |= {"P2PDIST_SEED": SEED, "P2PDIST_WORLD": "2", "P2PDIST_LAN": "1"}
    base |= {"P2PDIST_LISTEN": "127.0.0.1:0"}
    procs = [
        _start(prefix, "-", str(r), "2", env={**base, "P2PDIST_RANK": str(r)}) for r in range(2)
    ]
    for out in _results(procs):
        assert out.get("sum") == [3.0] * 4, out
        assert all(str(a).startswith("127.0.0.1:") for a in out["dialed"].values()), out


def test_a_rank_not_found_fails_the_start_naming_it(loopback_namespace: Lan) -> None:
    """Only rank 2 of 3 runs: its start fails after connect_timeout, naming ranks 0 and
    1 as not found on the local network, and saying what else works."""
    prefix = loopback_namespace.exec_prefix(0)
    started = time.monotonic()
    (out,) = _results([_start(prefix, SEED, "2", "3", "127.0.0.1:0", "3")])
    assert time.monotonic() - started < 20
    assert out.get("error") == "P2PTimeoutError", out
    text = str(out["text"])
    assert "forming the group took over 3 s" in text, text
    assert "rank 0 (" in text and "rank 1 (" in text, text
    assert "(not found on the local network; ranks on other networks need peers= or relay=)" in (
        text
    ), text


def test_a_rank_restarted_while_the_group_forms_is_found_at_its_new_port(
    loopback_namespace: Lan,
) -> None:
    """Rank 2 finds rank 0 and connects; rank 0 is killed (no goodbye) and started again,
    on another port; rank 1 comes last. Rank 2 looks rank 0 up again after its old
    address refuses (it kept dialing the old port until the start timed out: a
    reviewer), and the group forms."""
    prefix = loopback_namespace.exec_prefix(0)
    args = ("3", "127.0.0.1:0", "30")
    first = _start(prefix, SEED, "0", *args)
    third = _start(prefix, SEED, "2", *args)
    time.sleep(4)  # rank 2 has found rank 0 and is connected (both wait for rank 1)
    first.send_signal(signal.SIGKILL)
    first.communicate(timeout=10)
    again = _start(prefix, SEED, "0", *args)
    time.sleep(2)
    second = _start(prefix, SEED, "1", *args)
    for out in _results([again, second, third]):
        assert out.get("sum") == [6.0] * 4, out


def test_a_rank_restarted_unannounced_is_asked_for_again() -> None:
    """Rank 1 has rank 0's first port cached, and its dials there are refused; rank 0 is
    killed and started again on another port while its host drops its mDNS packets, so
    its announcements of the new port are lost, then lets them out again. Rank 1 drops
    its cached records after each failed round and asks the network, and the group
    forms (a lookup answered from zeroconf's cache, which keeps the records 120 s, past
    this run's 20 s connect_timeout, and rank 1 dialed the old port until it timed out:
    an audit)."""
    require_root()
    with Lan(2) as lan:
        h0 = lan.exec_prefix(0)
        refuse = ["INPUT", "-p", "tcp", "--dport", "4242", "-j", "REJECT"]
        subprocess.run([*h0, "iptables", "-A", *refuse, "--reject-with", "tcp-reset"], check=True)
        first = _start(h0, SEED, "0", "2", "0.0.0.0:4242", "20")
        time.sleep(2)  # announced
        second = _start(lan.exec_prefix(1), SEED, "1", "2", "", "20")
        time.sleep(3)  # rank 1 found port 4242, and its dials there are refused
        first.send_signal(signal.SIGKILL)
        first.communicate(timeout=10)
        quiet = ["OUTPUT", "-p", "udp", "--dport", "5353", "-j", "DROP"]
        subprocess.run([*h0, "iptables", "-A", *quiet], check=True)
        again = _start(h0, SEED, "0", "2", "0.0.0.0:4243", "20")
        time.sleep(4)  # claimed and announced: none of it got out
        subprocess.run([*h0, "iptables", "-D", *quiet], check=True)
        for out in _results([again, second]):
            assert out.get("sum") == [3.0] * 4, out
        assert out["dialed"] == {"0": f"{lan.ip(0)}:4243"}, out


def test_discovery_without_an_interface_it_can_use_is_a_usage_error() -> None:
    """A host whose only interface is down: the start fails with a UsageError naming
    the rank and saying what else works (zeroconf's own OSError or RuntimeError came
    out of Group.start() as it was: an audit)."""
    require_root()
    ns = f"{PREFIX}bare-{os.getpid()}"  # a namespace of its own, its loopback down
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        for listen in ("", "127.0.0.1:0"):  # every interface (none is up), or loopback's
            procs = [_start(["ip", "netns", "exec", ns], SEED, "1", "2", listen, "5")]
            (out,) = _results(procs)
            assert out.get("error") == "UsageError", out
            assert "rank 1" in out["text"], out
            assert "local network discovery cannot start" in out["text"], out
            assert "give peers= or relay=" in out["text"], out
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)


def test_a_second_process_with_the_same_rank_is_told_so() -> None:
    """Two hosts run rank 1: the second cannot claim the rank's name, and its start
    fails saying so (it raised zeroconf's NonUniqueNameException, with no text: a
    reviewer)."""
    require_root()
    with Lan(2) as lan:
        holder = _start(lan.exec_prefix(0), SEED, "1", "2", "", "20")  # waits for rank 0
        try:
            time.sleep(3)
            (out,) = _results([_start(lan.exec_prefix(1), SEED, "1", "2", "", "2")])
            assert out.get("error") == "UsageError", out
            assert "another process announces this rank on the local network" in out["text"]
            assert "rank 1 (" in str(out["text"]), out
        finally:
            holder.kill()
            holder.wait()


_WITHDRAW = """
import asyncio
from p2pdist.discovery import LanDiscovery
from p2pdist.identity import SecretKey

async def main():
    me = SecretKey.generate().endpoint_id
    a = LanDiscovery(me, "127.0.0.1", 4242, "rank 0")
    b = LanDiscovery(SecretKey.generate().endpoint_id, "127.0.0.1", 4243, "rank 1")
    await a.start()
    await b.start()
    print("before", await b.lookup(me))
    await asyncio.wait_for(a.close(), 5)
    await asyncio.sleep(1.5)  # a goodbye's records expire in a second
    print("after", await b.lookup(me))
    await b.close()

asyncio.run(main())
"""


def test_a_closed_rank_withdraws_its_announcement(loopback_namespace: Lan) -> None:
    """Closing sends the goodbye (it was scheduled, then dropped as the instance closed:
    a reviewer): another instance that had the rank's address forgets it."""
    prefix = loopback_namespace.exec_prefix(0)
    run = [*prefix, sys.executable, "-c", _WITHDRAW]
    out = subprocess.run(run, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert "before ['127.0.0.1:4242']" in out.stdout, out
    assert "after []" in out.stdout, out


class _FakeZeroconf:
    """zeroconf's AsyncZeroconf as LanDiscovery uses it, claiming names or not."""

    claims = True
    made: ClassVar[list[_FakeZeroconf]] = []

    def __init__(self, **_: object) -> None:
        self.said_goodbye = False
        self.goodbye_sent = False
        self.closed = False
        _FakeZeroconf.made.append(self)

    async def async_register_service(self, info: object) -> object:
        if not self.claims:
            raise NonUniqueNameException
        return asyncio.ensure_future(asyncio.sleep(10))  # its announcements

    async def async_unregister_service(self, info: object) -> object:
        self.said_goodbye = True

        async def send() -> None:
            self.goodbye_sent = not self.closed

        return asyncio.ensure_future(send())

    async def async_close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("claims", [True, False])
async def test_only_a_rank_that_claimed_its_name_says_goodbye_for_it(
    claims: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second process of a rank fails its start, and its close said goodbye for the
    name of the process that holds it, so the others forgot that one (a reviewer). One
    that claimed it sends its goodbye before it closes (it was dropped unsent: a
    reviewer)."""
    import p2pdist.discovery as discovery

    monkeypatch.setattr(discovery, "AsyncZeroconf", _FakeZeroconf)
    monkeypatch.setattr(_FakeZeroconf, "claims", claims)
    lan = LanDiscovery(SecretKey.generate().endpoint_id, "127.0.0.1", 4242, "rank 0")
    if claims:
        await lan.start()
    else:
        with pytest.raises(UsageError, match="rank 0: another process announces this rank"):
            await lan.start()
    await lan.close()
    zc = _FakeZeroconf.made[-1]
    assert zc.closed and zc.said_goodbye == claims and zc.goodbye_sent == claims


async def test_a_group_of_one_rank_opens_nothing() -> None:
    """Neither peers nor relay at world 1: no socket, no announcement."""
    async with Group.from_seed(SEED, rank=0, world=1) as g:
        assert g.size == 1 and g._discovery is None and g._transport is None


class FakeDiscovery:
    """A LanDiscovery stand-in for ``_dial_found``: each lookup answers the next of
    ``answers`` (the last one again once they are used up)."""

    def __init__(self, *answers: list[str]) -> None:
        self.answers = list(answers)
        self.found: dict[Any, list[str]] = {}

    async def lookup(self, peer: Any) -> list[str]:
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]

    def forget(self, peer: Any) -> None:
        pass


class Connected:
    """What a stand-in transport's ``connect_any`` returns: a connection from ``ip``."""

    def __init__(self, ip: str) -> None:
        self.remote_address = (ip, 1)


async def test_each_discovery_round_starts_the_race_at_the_next_address() -> None:
    """An address that always wins the TCP race and then hangs in its handshake (a
    service on that port that never answers; one that fails it is dropped by
    connect_any) would win every round's race, in the same order: each round starts at
    the next address instead (a review)."""
    group = Group.from_seed("rotating-race-seed-0123", rank=1, world=2)  # (not started)
    orders: list[list[str]] = []

    class Transport:
        async def connect_any(self, peer: Any, addresses: list[str], label: str) -> Connected:
            orders.append(list(addresses))
            if len(orders) < 3:
                raise ConnectionBrokenError(label, "connection lost")  # worth retrying
            return Connected("10.3.0.1")

    group._discovery = FakeDiscovery(["10.1.0.1:1", "10.2.0.1:1", "10.3.0.1:1"])  # type: ignore[assignment]
    got = await asyncio.wait_for(group._dial_found(Transport(), 0), 15)  # type: ignore[arg-type]
    assert isinstance(got, Connected)
    assert [order[0] for order in orders] == ["10.1.0.1:1", "10.2.0.1:1", "10.3.0.1:1"]
    assert all(sorted(order) == sorted(orders[0]) for order in orders)


async def test_a_lone_address_that_drops_what_it_is_sent_is_cut_short_too() -> None:
    """An mDNS answer may carry only some of a rank's addresses. When the only one known
    dropped what was sent to it, the dial had no bound but the handshake's, longer than
    a whole connect_timeout (a CI run failed so): now it is cut after FOUND_DIAL_BOUND
    and the next round asks the network again, which names the address that works."""
    group = Group.from_seed("lone-address-seed-0123", rank=1, world=2)  # (not started)
    discovery = FakeDiscovery(["10.99.0.1:1"], ["10.77.0.1:1"])
    dialed: list[str] = []

    class Transport:
        async def connect_any(self, peer: Any, addresses: list[str], label: str) -> Connected:
            dialed.extend(addresses)
            if addresses[0].startswith("10.99."):
                await asyncio.sleep(3600)  # dropped: no answer, ever
            return Connected("10.77.0.1")

    group._discovery = discovery  # type: ignore[assignment]
    got = await asyncio.wait_for(group._dial_found(Transport(), 0), 15)  # type: ignore[arg-type]
    assert isinstance(got, Connected) and dialed[-1] == "10.77.0.1:1", dialed
    assert discovery.found[group._ids[0]] == ["10.77.0.1:1"]
