"""This host's interface addresses (p2pdist/transport/interfaces.py), read inside a
namespace the test builds (as root; elsewhere it skips, saying why)."""

from __future__ import annotations

import json
import subprocess
import sys

from natlab import Lan, require_root

LIST = (
    "import json; from p2pdist.transport.interfaces import interface_addresses, local_ipv4;"
    "print(json.dumps([interface_addresses(), [[a, str(n)] for a, n in local_ipv4()]]))"
)


def _listed(lan: Lan) -> tuple[list[str], list[list[str]]]:
    """interface_addresses() and local_ipv4() as host 0 of ``lan`` sees them."""
    out = subprocess.run(
        [*lan.exec_prefix(0), sys.executable, "-c", LIST],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    addresses, networks = json.loads(out)
    return addresses, networks


def test_every_ipv4_address_of_an_interface_is_listed() -> None:
    """An interface with a second address (a VIP, a container host's extra subnet): the
    ioctl the host candidates were read with gave one address per interface, so a
    rank on the second subnet never got this host's address there."""
    require_root()
    with Lan(1) as lan:
        ns = lan.host_ns(0)
        subprocess.run(["ip", "-n", ns, "addr", "add", "10.88.0.5/16", "dev", "eth0"], check=True)
        addresses, networks = _listed(lan)
    assert addresses == [lan.ip(0), "10.88.0.5", "127.0.0.1"], addresses
    assert [lan.ip(0), "10.77.0.0/24"] in networks and ["10.88.0.5", "10.88.0.0/16"] in networks


def test_an_interface_with_many_addresses_leaves_room_for_the_others() -> None:
    """IPVS puts a virtual address per service on one interface: listed interface by
    interface, those pushed a later interface's LAN address past hole punching's 16
    candidates. Now each interface's first address comes before any one's second."""
    require_root()
    with Lan(1) as lan:
        ns = lan.host_ns(0)
        ip = ["ip", "-n", ns]
        for name in ("vips0", "lan1"):  # (veth: this kernel may have no dummy driver)
            subprocess.run(
                [*ip, "link", "add", name, "type", "veth", "peer", f"{name}p"], check=True
            )
        for i in range(1, 41):
            subprocess.run([*ip, "addr", "add", f"10.66.0.{i}/32", "dev", "vips0"], check=True)
        subprocess.run([*ip, "addr", "add", "10.99.0.5/24", "dev", "lan1"], check=True)
        addresses, _ = _listed(lan)
    assert addresses[:4] == [lan.ip(0), "10.66.0.1", "10.99.0.5", "10.66.0.2"], addresses
    assert len(addresses) == 43 and addresses[-1] == "127.0.0.1", addresses
