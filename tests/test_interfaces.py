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


def test_every_ipv4_address_of_an_interface_is_listed() -> None:
    """An interface with a second address (a VIP, a container host's extra subnet): the
    ioctl the host candidates were read with gave one address per interface, so a
    rank on the second subnet never got this host's address there."""
    require_root()
    with Lan(1) as lan:
        ns = lan.host_ns(0)
        subprocess.run(["ip", "-n", ns, "addr", "add", "10.88.0.5/16", "dev", "eth0"], check=True)
        out = subprocess.run(
            [*lan.exec_prefix(0), sys.executable, "-c", LIST],
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
    addresses, networks = json.loads(out)
    assert addresses == [lan.ip(0), "10.88.0.5", "127.0.0.1"], addresses
    assert [lan.ip(0), "10.77.0.0/24"] in networks and ["10.88.0.5", "10.88.0.0/16"] in networks
