"""Groups formed with neither peers= nor relay=: the ranks find each other on the local
network by mDNS (p2pdist/discovery.py). The network tests run inside namespaces they
build (a LAN of namespaces, or one namespace's loopback with multicast on), as root;
elsewhere they skip, saying why."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import subprocess
import sys
from pathlib import Path

import pytest
from natlab import Lan, require_root

from p2pdist import UsageError
from p2pdist.discovery import LanDiscovery, pick_address
from p2pdist.identity import SecretKey

WORKER = Path(__file__).with_name("discovery_worker.py")
ROOT = Path(__file__).resolve().parent.parent
SEED = "a long shared secret seed for discovery"


def _net(cidr: str) -> tuple[str, ipaddress.IPv4Network]:
    return cidr.split("/")[0], ipaddress.IPv4Network(cidr, strict=False)


def test_the_address_dialed_is_one_on_a_network_this_host_shares() -> None:
    ours = [_net("10.77.0.2/24"), _net("127.0.0.1/8")]
    assert pick_address(["172.17.0.1", "10.77.0.5"], ours) == "10.77.0.5"
    assert pick_address(["172.17.0.1", "192.168.9.9"], ours) == "172.17.0.1"  # none: first


def test_discovery_needs_an_ipv4_listen_address() -> None:
    me = SecretKey.generate().endpoint_id
    for host in ("::", "::1", "example.org"):
        with pytest.raises(UsageError, match="IPv4"):
            LanDiscovery(me, host, 1234)


def _run_ranks(prefixes: list[list[str]], args: list[list[str]]) -> list[dict[str, object]]:
    """Start one worker per rank (``prefixes[r]`` before it: the namespace), wait for all
    (bounded), and return each one's JSON line."""
    procs = [
        subprocess.Popen(
            [*prefix, sys.executable, str(WORKER), *argv],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for prefix, argv in zip(prefixes, args, strict=True)
    ]
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
    dialed the others at their LAN addresses. Host 0 also has an address no other host
    reaches (as a docker bridge's), which it announces first: the others dial the one on
    the LAN they share."""
    require_root()
    with Lan(3) as lan:
        # (On lo, listed first: announced before the LAN address, and unreachable.)
        lo = ["ip", "-n", lan.host_ns(0), "addr", "add", "172.31.9.1/32", "dev", "lo"]
        subprocess.run(lo, check=True)
        outs = _run_ranks(
            [lan.exec_prefix(r) for r in range(3)], [[SEED, str(r), "3"] for r in range(3)]
        )
        for r, out in enumerate(outs):
            assert out.get("sum") == [6.0] * 4, (r, out)
            peers = out["peers"]
            assert isinstance(peers, list)
            for p, address in enumerate(peers):
                if p != r:
                    assert str(address).startswith(f"{lan.ip(p)}:"), (r, peers)


@pytest.fixture
def loopback_namespace() -> object:
    """A namespace of its own whose loopback carries multicast (mDNS on 127.0.0.1)."""
    require_root()
    with Lan(1) as lan:
        ns = lan.host_ns(0)
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "multicast", "on"], check=True)
        subprocess.run(["ip", "-n", ns, "route", "add", "224.0.0.0/4", "dev", "lo"], check=True)
        yield lan


def test_ranks_on_one_host_find_each_other_over_loopback(loopback_namespace: Lan) -> None:
    """listen="127.0.0.1:0" keeps mDNS on loopback: ranks of one host only."""
    prefix = loopback_namespace.exec_prefix(0)
    outs = _run_ranks([prefix] * 2, [[SEED, str(r), "2", "127.0.0.1:0"] for r in range(2)])
    for out in outs:
        assert out.get("sum") == [3.0] * 4, out
        assert all(str(p).startswith("127.0.0.1:") for p in out["peers"]), out  # type: ignore[attr-defined]


def test_a_rank_not_found_fails_the_start_naming_it(loopback_namespace: Lan) -> None:
    """Only rank 0 of 3 runs: its start fails after connect_timeout, naming ranks 1 and
    2, and saying what else works."""
    prefix = loopback_namespace.exec_prefix(0)
    (out,) = _run_ranks([prefix], [[SEED, "0", "3", "127.0.0.1:0", "2"]])
    assert out.get("error") == "P2PTimeoutError", out
    text = str(out["text"])
    assert "2 of 2 ranks not found on the local network within 2 s" in text, text
    assert "rank 1 (" in text and "rank 2 (" in text and "peers= or relay=" in text, text


async def test_a_group_without_peers_or_relay_of_one_rank_needs_no_network() -> None:
    from p2pdist import Group

    async with Group.from_seed(SEED, rank=0, world=1) as g:
        assert g.size == 1
    await asyncio.sleep(0)
