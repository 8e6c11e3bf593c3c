"""A NAT lab made of Linux network namespaces, built and torn down by the tests.

Topology (all addresses exist only inside the lab's namespaces)::

    side a                     "internet" namespace                 side b
    host 10.0.0.2 ── router ── bridge br0, relay 203.0.113.1 ── router ── host 10.0.0.2
         (LAN 10.0.0.0/24)   WAN 203.0.113.10        WAN 203.0.113.20  (the same LAN subnet)

Each side is one of :data:`KINDS`:

- ``"none"``: no router; the host sits on the bridge with its own public address
  (203.0.113.10 or .20).
- ``"eim"``: MASQUERADE, i.e. endpoint-independent mapping with address-and-port-
  dependent filtering (the common home router; hole punching works when both sides
  send).
- ``"symmetric"``: MASQUERADE --random-fully, i.e. endpoint-dependent mapping (a new
  public port per destination; punching fails, the relay is needed).
- ``"udp-blocked"``: ``"eim"`` that also drops all forwarded UDP (TCP still works).

With ``ipv6=True`` every namespace also gets IPv6, with no NAT (as an ISP's IPv6 is):
the internet is 2001:db8:100::/64 (relay ::1, WAN addresses ::10 and ::20), each LAN
2001:db8:a::/64 or 2001:db8:b::/64 (router ::1, host ::2), and each router is a stateful
firewall (ip6tables, the same filter as its IPv4 one: unsolicited inbound dropped).
``nat66=True`` adds the IPv4 rule's NAT to IPv6 as well (MASQUERADE to the router's WAN
address, as NAT66 routers do): then only the observed address of an IPv6 host works.

Routers drop unsolicited inbound (FORWARD and INPUT policy DROP; ESTABLISHED,RELATED and
LAN->WAN accepted). They must: a router that accepted an early punch packet would let
conntrack move the host's next mapping to a new port, and the NAT would then behave as
symmetric (docs: GUIDE.md, section 6).

Usage::

    with NatLab("eim", "symmetric", workdir=tmp_path) as lab:
        url = lab.spawn_relay()
        a = lab.udp_agent("a")                        # one UDP socket on host a
        mapped = a.stun(lab.relay_ip, lab.stun_ports)  # [(ip, port) | None, ...]
        proc = lab.spawn("b", [sys.executable, "-m", "p2pdist", ...])
        lab.block_udp("a")                            # at a's router, at run time

Namespaces are named ``p2pnat-<pid>-<n>-<role>``; a lab removes namespaces left behind
by a crashed run (whose pid is gone) when it starts, and everything of its own when it
ends, also on an exception. Everything runs as root: call :func:`require_root` first
(it skips the test with a reason when the lab cannot run here).

Run as a script, this module is the UDP agent that :meth:`NatLab.udp_agent` starts
inside a namespace (``python tests/natlab.py agent``): it holds one UDP socket and
answers JSON commands on stdin, one per line.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self

from relay_helpers import read_relay_url

__all__ = [
    "KINDS",
    "PREFIX",
    "NatLab",
    "NatLabError",
    "Lan",
    "ShapedLan",
    "UdpAgent",
    "lab_unavailable",
    "leftover_namespaces",
    "ipv6_unavailable",
    "require_ipv6",
    "require_root",
    "require_shaping",
    "shaping_unavailable",
]

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("none", "eim", "symmetric", "udp-blocked")
PREFIX = "p2pnat-"
RELAY_IP = "203.0.113.1"
PUBLIC_IP = {"a": "203.0.113.10", "b": "203.0.113.20"}
LAN_HOST_IP = "10.0.0.2"
LAN_ROUTER_IP = "10.0.0.1"
RELAY_IP6 = "2001:db8:100::1"
PUBLIC_IP6 = {"a": "2001:db8:100::10", "b": "2001:db8:100::20"}
LAN6 = {"a": "2001:db8:a::", "b": "2001:db8:b::"}
"""Each side's LAN prefix (a /64): its router is ``::1`` in it, its host ``::2``."""
_BLOCK_COMMENT = "natlab-block-udp"
SHAPED_NET = "10.77.0"
_counter = itertools.count()


class NatLabError(RuntimeError):
    """A lab command failed; the message names the command and its stderr."""


# ---- can the lab run here? ------------------------------------------------------------


def _run(argv: Sequence[str], *, input: str | None = None, check: bool = True) -> str:
    proc = subprocess.run(list(argv), input=input, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise NatLabError(f"{' '.join(argv)}: exit {proc.returncode}: {proc.stderr.strip()}")
    return proc.stdout


_unavailable: list[str | None] = []


def lab_unavailable() -> str | None:
    """Why the lab cannot run on this machine (not root, no ``ip``, ``iptables`` or
    ``sysctl``, namespaces or nf_tables refused), or None when it can. Probed once per
    process."""
    if _unavailable:
        return _unavailable[0]
    reason: str | None = None
    if os.geteuid() != 0:
        reason = "the NAT lab needs root (network namespaces, iptables)"
    else:
        packages = {"ip": "iproute2", "iptables": "iptables", "iptables-restore": "iptables"}
        packages["sysctl"] = "procps"  # per-router sysctls (forwarding, conntrack timeouts)
        missing = [t for t in packages if not shutil.which(t)]
        if missing:
            install = " ".join(dict.fromkeys(packages[t] for t in missing))
            reason = f"the NAT lab needs {', '.join(missing)} (apt-get install {install})"
    if reason is None:
        probe = f"{PREFIX}{os.getpid()}-probe"
        try:
            _run(["ip", "netns", "add", probe])
            _run(["ip", "netns", "exec", probe, "iptables", "-t", "nat", "-L", "-n"])
        except (NatLabError, OSError, subprocess.SubprocessError) as exc:
            reason = f"network namespaces or iptables do not work here: {exc}"
        finally:
            _run(["ip", "netns", "del", probe], check=False)
    _unavailable.append(reason)
    return reason


def ipv6_unavailable() -> str | None:
    """Why an ``ipv6=True`` :class:`NatLab` cannot run here (the lab's reasons, no
    ``ip6tables-restore``, or IPv6 off in this kernel), or None."""
    reason = lab_unavailable()
    if reason is None and not shutil.which("ip6tables-restore"):
        reason = "the IPv6 NAT lab needs ip6tables (apt-get install iptables)"
    if reason is None and not os.path.exists("/proc/net/if_inet6"):
        reason = "IPv6 is off in this kernel"
    return reason


def shaping_unavailable() -> str | None:
    """Why :class:`ShapedLan` cannot run here (the lab's reasons, or no ``tc``), or None."""
    reason = lab_unavailable()
    if reason is None and not shutil.which("tc"):
        reason = "shaped links need tc (apt-get install iproute2)"
    return reason


def _skip_if(reason: str | None) -> None:
    """Skip the calling test, printing the reason, when there is one."""
    import pytest

    if reason is not None:
        print(f"natlab: skipped: {reason}", file=sys.stderr)
        pytest.skip(reason)


def require_root() -> None:
    """Skip the calling test (printing the reason) when the lab cannot run here."""
    _skip_if(lab_unavailable())


def require_ipv6() -> None:
    """Skip the calling test (printing the reason) when an IPv6 lab cannot run here."""
    _skip_if(ipv6_unavailable())


def require_shaping() -> None:
    """Skip the calling test (printing the reason) when shaped links cannot run here."""
    _skip_if(shaping_unavailable())


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line]


def leftover_namespaces(prefix: str = PREFIX) -> list[str]:
    """Namespaces whose name starts with ``prefix`` (for tests and cleanup)."""
    return [n for n in _namespaces() if n.startswith(prefix)]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        pass
    return True


def _delete_namespace(ns: str) -> None:
    """Kill whatever still runs inside ``ns``, then delete it."""
    pids = _run(["ip", "netns", "pids", ns], check=False).split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    _run(["ip", "netns", "del", ns], check=False)


def _remove_stale() -> None:
    """Delete lab namespaces of runs whose process is gone (a crash, a SIGKILL)."""
    for ns in leftover_namespaces():
        owner = ns[len(PREFIX) :].split("-", 1)[0]
        if owner.isdigit() and not _pid_alive(int(owner)):
            _delete_namespace(ns)


# ---- the lab --------------------------------------------------------------------------


def _ruleset(kind: str, wan: str, lan: str) -> str:
    """iptables-restore input for a router of ``kind``."""
    masq = "-j MASQUERADE --random-fully" if kind == "symmetric" else "-j MASQUERADE"
    block = (
        f'-A FORWARD -p udp -m comment --comment "{_BLOCK_COMMENT}" -j DROP\n'
        if kind == "udp-blocked"
        else ""
    )
    return (
        "*nat\n:PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n"
        f":POSTROUTING ACCEPT [0:0]\n-A POSTROUTING -o {wan} {masq}\nCOMMIT\n"
        "*filter\n:INPUT DROP [0:0]\n:FORWARD DROP [0:0]\n:OUTPUT ACCEPT [0:0]\n"
        f"{block}"
        "-A FORWARD -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT\n"
        f"-A FORWARD -i {lan} -o {wan} -j ACCEPT\n"
        "-A INPUT -i lo -j ACCEPT\n"
        "-A INPUT -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT\n"
        f"-A INPUT -i {lan} -j ACCEPT\n"
        "COMMIT\n"
    )


def _ruleset6(kind: str, wan: str, lan: str, nat66: bool = False) -> str:
    """ip6tables-restore input for a router of ``kind``: the same stateful filter as
    :func:`_ruleset` (ICMPv6 to the router itself is let in: neighbour discovery), and
    no NAT unless ``nat66`` (then the IPv4 rule's MASQUERADE, as NAT66 routers do)."""
    block = (
        f'-A FORWARD -p udp -m comment --comment "{_BLOCK_COMMENT}" -j DROP\n'
        if kind == "udp-blocked"
        else ""
    )
    nat = _ruleset(kind, wan, lan).split("*filter", 1)[0] if nat66 else ""
    return (
        f"{nat}*filter\n:INPUT DROP [0:0]\n:FORWARD DROP [0:0]\n:OUTPUT ACCEPT [0:0]\n"
        f"{block}"
        "-A FORWARD -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT\n"
        f"-A FORWARD -i {lan} -o {wan} -j ACCEPT\n"
        "-A INPUT -i lo -j ACCEPT\n"
        "-A INPUT -p ipv6-icmp -j ACCEPT\n"
        "-A INPUT -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT\n"
        f"-A INPUT -i {lan} -j ACCEPT\n"
        "COMMIT\n"
    )


def _block_rule(
    ns: str, action: str, chain: str, tool: str = "iptables", *, udp_only: bool = True
) -> list[str]:
    """``iptables -I``/``-D`` (or ``ip6tables``) of the block rule in ``ns``: UDP only
    (:meth:`NatLab.block_udp`), or everything (:meth:`NatLab.block_all`)."""
    proto = ["-p", "udp"] if udp_only else []
    rule = [*proto, "-m", "comment", "--comment", _BLOCK_COMMENT, "-j", "DROP"]
    return ["ip", "netns", "exec", ns, tool, action, chain, *rule]


class _NamespaceLab:
    """What every lab of namespaces shares: building them in ``with`` (stale ones of
    crashed runs removed first; everything torn down if the build fails) and the
    namespaces it made. Subclasses build (``_build``) and tear down (``close``)."""

    _namespaces: list[str]

    def _unavailable(self) -> str | None:
        """Why this lab cannot run here (None: it can)."""
        return lab_unavailable()

    def _prepare(self) -> None:
        """Set-up before the build (nothing by default)."""

    def _build(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        reason = self._unavailable()
        if reason is not None:
            raise NatLabError(reason)
        _remove_stale()
        self._prepare()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _ns(self, name: str) -> str:
        _run(["ip", "netns", "add", name])
        self._namespaces.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])
        return name


class NatLab(_NamespaceLab):
    """Two sides (``"a"``, ``"b"``) of the given kinds, an internet namespace with a
    bridge, and optionally a real relay in it. A context manager: ``__enter__`` builds
    it, ``__exit__`` kills every process it started and deletes every namespace.

    ``udp_timeout`` (seconds) sets both routers' conntrack UDP timeouts (see
    :meth:`set_udp_timeout`); ``workdir`` holds the relay's log (default: a temporary
    directory removed at teardown); ``ipv6`` adds IPv6 everywhere (see the module).
    """

    relay_ip = RELAY_IP
    """The relay host's address in the internet namespace."""
    relay_ip6 = RELAY_IP6
    """The relay host's IPv6 address in the internet namespace (``ipv6=True`` labs)."""
    lan_host_ip = LAN_HOST_IP
    """The address of the host behind every router (the same on both sides)."""

    def __init__(
        self,
        a: str = "eim",
        b: str = "eim",
        *,
        udp_timeout: int | None = None,
        workdir: Path | None = None,
        ipv6: bool = False,
        nat66: bool = False,
    ) -> None:
        if nat66 and not ipv6:
            raise ValueError("nat66 needs ipv6=True")
        for kind in (a, b):
            if kind not in KINDS:
                raise ValueError(f"NAT kind must be one of {', '.join(KINDS)}, got {kind!r}")
        self.kinds = {"a": a, "b": b}
        self.ipv6 = ipv6
        self.nat66 = nat66
        self.prefix = f"{PREFIX}{os.getpid()}-{next(_counter)}-"
        self.inet_ns = self.prefix + "inet"
        self._udp_timeout = udp_timeout
        self._own_workdir = workdir is None
        self.workdir = workdir if workdir is not None else Path("/nonexistent")
        self._namespaces: list[str] = []
        self._procs: list[subprocess.Popen[Any]] = []
        self._files: list[IO[Any]] = []
        self.relay_url: str | None = None
        self.relay_port = 0
        """The relay's TCP port (after :meth:`spawn_relay`)."""
        self.stun_ports: tuple[int, ...] = ()
        """The relay's bound UDP observation ports, STUN first (after spawn_relay)."""
        self.relay_log: Path | None = None
        self.relay_proc: subprocess.Popen[bytes] | None = None

    # ---- names and addresses ------------------------------------------------------

    def _side(self, side: str) -> str:
        if side not in self.kinds:
            raise ValueError(f"side must be 'a' or 'b', got {side!r}")
        return side

    def _unavailable(self) -> str | None:
        return ipv6_unavailable() if self.ipv6 else lab_unavailable()

    def kind(self, side: str) -> str:
        """The NAT kind of ``side``."""
        return self.kinds[self._side(side)]

    def host_ns(self, side: str) -> str:
        """The namespace of the host on ``side``."""
        return self.prefix + "h" + self._side(side)

    def router_ns(self, side: str) -> str | None:
        """The namespace of the router on ``side`` (None for kind ``"none"``)."""
        return None if self.kind(side) == "none" else self.prefix + "r" + side

    def public_ip(self, side: str) -> str:
        """The router's WAN address, or the host's own public address for ``"none"``."""
        return PUBLIC_IP[self._side(side)]

    def host_ip(self, side: str) -> str:
        """The address the host's sockets bind: its LAN address behind a router, its
        public address for ``"none"``."""
        return self.public_ip(side) if self.kind(side) == "none" else LAN_HOST_IP

    def public_ip6(self, side: str) -> str:
        """The IPv6 address of ``side`` on the internet (its router's WAN address, or
        the host's own for ``"none"``; ``ipv6=True`` labs)."""
        if not self.ipv6:
            raise NatLabError("this lab has no IPv6 (NatLab(..., ipv6=True))")
        return PUBLIC_IP6[side]

    def host_ip6(self, side: str) -> str:
        """The host's IPv6 address (``ipv6=True`` labs): global, behind no NAT unless
        ``nat66``."""
        if not self.ipv6:
            raise NatLabError("this lab has no IPv6 (NatLab(..., ipv6=True))")
        if self.kind(side) == "none":
            return PUBLIC_IP6[side]
        return LAN6[side] + "2"

    def ns_of(self, where: str) -> str:
        """``"a"``/``"b"`` (the hosts) or ``"internet"`` -> namespace name."""
        return self.inet_ns if where == "internet" else self.host_ns(where)

    # ---- build and teardown -------------------------------------------------------

    def _prepare(self) -> None:
        if self._own_workdir:
            self.workdir = Path(tempfile.mkdtemp(prefix="natlab-"))

    def _ip(self, ns: str, *args: str) -> None:
        _run(["ip", "-n", ns, *args])

    def _sysctl(self, ns: str, values: dict[str, int]) -> None:
        args = [f"{k}={v}" for k, v in values.items()]
        _run(["ip", "netns", "exec", ns, "sysctl", "-qw", *args])

    def _build(self) -> None:
        inet = self._ns(self.inet_ns)
        self._ip(inet, "link", "add", "br0", "type", "bridge")
        self._ip(inet, "addr", "add", f"{RELAY_IP}/24", "dev", "br0")
        self._ip(inet, "link", "set", "br0", "up")
        for side in ("a", "b"):
            host = self._ns(self.host_ns(side))
            router = self.router_ns(side)
            # The namespace attached to the bridge: the router, or the host itself.
            outer = self._ns(router) if router is not None else host
            port = f"to{side}"
            self._ip(
                inet, "link", "add", port, "type", "veth", "peer", "name", "wan0", "netns", outer
            )
            self._ip(inet, "link", "set", port, "master", "br0", "up")
            self._ip(outer, "addr", "add", f"{PUBLIC_IP[side]}/24", "dev", "wan0")
            self._ip(outer, "link", "set", "wan0", "up")
            if router is None:
                continue
            self._ip(
                router, "link", "add", "lan0", "type", "veth", "peer", "name", "eth0", "netns", host
            )
            self._ip(router, "addr", "add", f"{LAN_ROUTER_IP}/24", "dev", "lan0")
            self._ip(router, "link", "set", "lan0", "up")
            self._ip(host, "addr", "add", f"{LAN_HOST_IP}/24", "dev", "eth0")
            self._ip(host, "link", "set", "eth0", "up")
            self._ip(host, "route", "add", "default", "via", LAN_ROUTER_IP)
            self._sysctl(router, {"net.ipv4.ip_forward": 1})
            rules = _ruleset(self.kind(side), "wan0", "lan0")
            _run(["ip", "netns", "exec", router, "iptables-restore"], input=rules)
            if self._udp_timeout is not None:
                self.set_udp_timeout(side, self._udp_timeout)
        if self.ipv6:
            self._build_ipv6()

    def _ns(self, name: str) -> str:
        ns = super()._ns(name)
        if self.ipv6:
            # Before any link exists here: link-local addresses would otherwise stay
            # "tentative" for about a second, and a router sends no neighbour
            # discovery for forwarded packets until they are usable.
            dad_off = {"net.ipv6.conf.all.accept_dad": 0, "net.ipv6.conf.default.accept_dad": 0}
            self._sysctl(ns, dad_off)
        return ns

    def _addr6(self, ns: str, addr: str, dev: str) -> None:
        # nodad: usable at once (duplicate address detection would hold it ~1 s).
        self._ip(ns, "-6", "addr", "add", addr, "dev", dev, "nodad")

    def _build_ipv6(self) -> None:
        """IPv6 on the links :meth:`_build` made: routed, firewalled, never NATed."""
        inet = self.inet_ns
        self._addr6(inet, f"{RELAY_IP6}/64", "br0")
        for side in ("a", "b"):
            other = "b" if side == "a" else "a"
            router = self.router_ns(side)
            outer = router if router is not None else self.host_ns(side)
            self._addr6(outer, f"{PUBLIC_IP6[side]}/64", "wan0")
            if self.router_ns(other) is not None:  # the other side's LAN, via its router
                via = ["via", PUBLIC_IP6[other]]
                self._ip(outer, "-6", "route", "add", f"{LAN6[other]}/64", *via)
            if router is None:
                continue
            self._ip(inet, "-6", "route", "add", f"{LAN6[side]}/64", "via", PUBLIC_IP6[side])
            host = self.host_ns(side)
            self._addr6(router, f"{LAN6[side]}1/64", "lan0")
            self._addr6(host, f"{LAN6[side]}2/64", "eth0")
            self._ip(host, "-6", "route", "add", "default", "via", f"{LAN6[side]}1")
            self._sysctl(router, {"net.ipv6.conf.all.forwarding": 1})
            rules = _ruleset6(self.kind(side), "wan0", "lan0", self.nat66)
            _run(["ip", "netns", "exec", router, "ip6tables-restore"], input=rules)
        deadline = time.monotonic() + 10.0
        while any(
            _run(["ip", "-n", ns, "-6", "addr", "show", "tentative"]).strip()
            for ns in self._namespaces
        ):
            if time.monotonic() > deadline:
                raise NatLabError("IPv6 addresses still tentative after 10 s")
            time.sleep(0.05)

    def close(self) -> None:
        """Kill every process started here, delete every namespace (idempotent)."""
        for proc in reversed(self._procs):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()
        deadline = time.monotonic() + 3.0
        for proc in self._procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
        self._procs.clear()
        for fh in self._files:
            fh.close()
        self._files.clear()
        for ns in reversed(self._namespaces):
            _delete_namespace(ns)
        self._namespaces.clear()
        if self._own_workdir and self.workdir.name.startswith("natlab-"):
            shutil.rmtree(self.workdir, ignore_errors=True)

    # ---- processes ----------------------------------------------------------------

    def exec_prefix(self, where: str) -> list[str]:
        """``ip netns exec NS`` for ``"a"``, ``"b"`` or ``"internet"``."""
        return ["ip", "netns", "exec", self.ns_of(where)]

    def spawn(self, where: str, argv: Sequence[str], **popen_kw: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside host ``"a"``/``"b"`` (or ``"internet"``); cwd defaults
        to the repository root. Terminated (then killed) at teardown."""
        popen_kw.setdefault("cwd", ROOT)
        proc: subprocess.Popen[Any] = subprocess.Popen(
            [*self.exec_prefix(where), *argv], **popen_kw
        )
        self._procs.append(proc)
        return proc

    def spawn_relay(self, *extra_args: str, timeout: float = 30.0) -> str:
        """Start ``python -m relay`` on 203.0.113.1 (port 0: STUN on the TCP port's
        number and the alternate port + 1) in the internet namespace; return its URL.
        ``extra_args`` are appended (later flags win). Its log is :attr:`relay_log`."""
        if self.relay_proc is not None:
            raise NatLabError("the lab already has a relay")
        self.relay_log = self.workdir / f"relay-{self.prefix}log"
        log = self.relay_log.open("wb")
        self._files.append(log)
        argv = [sys.executable, "-m", "relay", "--host", RELAY_IP, "--port", "0", *extra_args]
        proc = self.spawn("internet", argv, stdout=subprocess.PIPE, stderr=log)
        self.relay_proc = proc
        assert proc.stdout is not None
        try:
            self.relay_url = read_relay_url(proc.stdout, timeout)
        except ValueError as exc:
            raise NatLabError(f"{exc}; log:\n{self.relay_log.read_text()}") from None
        from p2pdist.wire.relay import RelayUrl

        self.relay_port = RelayUrl.parse(self.relay_url).port
        # The log's "listening" line (written before the url) names the bound UDP ports.
        found = re.search(r" stun=(\S+) stun_alt=(\S+)", self.relay_log.read_text())
        self.stun_ports = tuple(int(p) for p in (found.groups() if found else ()) if p.isdigit())
        return self.relay_url

    def udp_agent(self, where: str, port: int = 0, *, ipv6: bool = False) -> UdpAgent:
        """A :class:`UdpAgent` holding one UDP socket bound to the host's address (its
        IPv6 one with ``ipv6``) and ``port`` (0: any) inside ``where``; stopped at
        teardown."""
        if where == "internet":
            ip = RELAY_IP6 if ipv6 else RELAY_IP
        else:
            ip = self.host_ip6(where) if ipv6 else self.host_ip(where)
        argv = [sys.executable, "-u", str(Path(__file__).resolve()), "agent", ip, str(port)]
        proc = self.spawn(where, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        return UdpAgent(proc)

    # ---- runtime changes at the routers -------------------------------------------

    def _filter_ns(self, side: str) -> str:
        return self.router_ns(side) or self.host_ns(side)

    def block_udp(self, side: str, *, udp_only: bool = True) -> None:
        """Drop all UDP at ``side``'s router (forwarded, established flows too); for a
        ``"none"`` side, drop UDP in and out of the host itself."""
        ns = self._filter_ns(side)
        chains = ["FORWARD"] if self.router_ns(side) else ["INPUT", "OUTPUT"]
        for tool in self._filter_tools():
            for chain in chains:
                _run(_block_rule(ns, "-I", chain, tool, udp_only=udp_only))

    def unblock_udp(self, side: str, *, udp_only: bool = True) -> None:
        """Undo :meth:`block_udp` (also lifts a ``"udp-blocked"`` router's block)."""
        ns = self._filter_ns(side)
        for tool in self._filter_tools():
            for chain in ("FORWARD", "INPUT", "OUTPUT"):
                argv = _block_rule(ns, "-D", chain, tool, udp_only=udp_only)
                while subprocess.run(argv, capture_output=True, timeout=30).returncode == 0:
                    pass  # one rule removed per run; stops when none is left

    def block_all(self, side: str) -> None:
        """An outage at ``side``: drop every packet (TCP too) as :meth:`block_udp` drops
        UDP; established connections stay in the kernel, silent, until
        :meth:`unblock_all`."""
        self.block_udp(side, udp_only=False)

    def unblock_all(self, side: str) -> None:
        """Undo :meth:`block_all`."""
        self.unblock_udp(side, udp_only=False)

    def _filter_tools(self) -> list[str]:
        return ["iptables", "ip6tables"] if self.ipv6 else ["iptables"]

    def set_udp_timeout(self, side: str, seconds: int, stream_seconds: int | None = None) -> None:
        """Conntrack UDP timeouts at ``side``'s router: ``seconds`` for flows seen one
        way, ``stream_seconds`` (default: the same) for flows seen both ways. Mappings
        then expire that long after their last packet; keepalive tests use a few s."""
        router = self.router_ns(side)
        if router is None:
            raise NatLabError(f"side {side} has no router (kind 'none')")
        self._sysctl(
            router,
            {
                "net.netfilter.nf_conntrack_udp_timeout": seconds,
                "net.netfilter.nf_conntrack_udp_timeout_stream": stream_seconds or seconds,
            },
        )


# ---- the UDP agent ----------------------------------------------------------------------


class Lan(_NamespaceLab):
    """``world`` hosts on one switch (a bridge that forwards multicast), each in its own
    namespace with address ``10.77.0.<r+1>/24`` on ``eth0``: machines on one LAN. A
    context manager, torn down as :class:`NatLab` is."""

    def __init__(self, world: int) -> None:
        if world < 1:
            raise ValueError("need at least one host")
        self.world = world
        self.prefix = f"{PREFIX}{os.getpid()}-{next(_counter)}-"
        self._namespaces: list[str] = []

    def host_ns(self, r: int) -> str:
        """The namespace of host ``r``."""
        return f"{self.prefix}h{r}"

    def ip(self, r: int) -> str:
        """Host ``r``'s address."""
        return f"{SHAPED_NET}.{r + 1}"

    def exec_prefix(self, r: int) -> list[str]:
        """``ip netns exec NS`` for host ``r``."""
        return ["ip", "netns", "exec", self.host_ns(r)]

    def _cabled(self, host: str, switch: str, port: str) -> None:
        """Host namespace ``host`` is cabled to the switch's ``port`` (both up)."""

    def _build(self) -> None:
        switch = self._ns(self.prefix + "switch")
        bridge = ["type", "bridge", "mcast_snooping", "0"]  # every host hears multicast
        _run(["ip", "-n", switch, "link", "add", "br0", *bridge])
        _run(["ip", "-n", switch, "link", "set", "br0", "up"])
        for r in range(self.world):
            host, port = self._ns(self.host_ns(r)), f"p{r}"
            veth = ["type", "veth", "peer", "name", "eth0", "netns", host]
            _run(["ip", "-n", switch, "link", "add", port, *veth])
            _run(["ip", "-n", switch, "link", "set", port, "master", "br0", "up"])
            _run(["ip", "-n", host, "addr", "add", f"{self.ip(r)}/24", "dev", "eth0"])
            _run(["ip", "-n", host, "link", "set", "eth0", "up"])
            self._cabled(host, switch, port)

    def close(self) -> None:
        """Delete every namespace (killing what still runs in them); idempotent."""
        for ns in reversed(self._namespaces):
            _delete_namespace(ns)
        self._namespaces.clear()


class ShapedLan(Lan):
    """A :class:`Lan` whose every host link is shaped to ``rate_bits`` per second each way
    (``tc`` token bucket on both ends of its cable), like a fleet of machines with
    ``rate_bits`` network cards. For benchmarks of slow links (``reduce_modes.py
    --rate``)."""

    def __init__(self, world: int, rate_bits: int) -> None:
        if rate_bits < 1_000_000:
            raise ValueError("need at least 1 Mbit/s")
        super().__init__(world)
        self.rate_bits = rate_bits

    def _unavailable(self) -> str | None:
        return shaping_unavailable()

    def _shape(self, ns: str, dev: str) -> None:
        # The bucket must hold a whole offloaded segment (64 KiB) and a few timer ticks'
        # worth of bytes, or the link runs below its rate.
        burst = max(256 * 1024, self.rate_bits // 8 // 100)
        bucket = ["rate", f"{self.rate_bits}bit", "burst", str(burst), "latency", "50ms"]
        _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", *bucket])

    def _cabled(self, host: str, switch: str, port: str) -> None:
        self._shape(host, "eth0")  # what the host sends
        self._shape(switch, port)  # what it receives


class UdpAgent:
    """Drives ``natlab.py agent`` (one UDP socket in a namespace) over its stdin/stdout.

    Addresses are ``(ip, port)`` tuples. Every call is bounded by its timeout plus a
    margin; :meth:`begin` / :meth:`finish` let two agents work at the same time (a hole
    punch needs both sides sending).
    """

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        hello = self._read(30.0)
        self.local: tuple[str, int] = (hello["local"][0], hello["local"][1])
        """The socket's own address (inside its namespace)."""

    def _read(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            raise NatLabError(f"UDP agent gave no answer within {timeout} s")
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise NatLabError(f"UDP agent: {reply['error']}")
        return reply

    def begin(self, op: str, **args: Any) -> float:
        """Send a command; returns the bound on its reply time for :meth:`finish`."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        return float(args.get("timeout", 1.0)) + 10.0

    def finish(self, bound: float) -> dict[str, Any]:
        """The reply to the command :meth:`begin` sent."""
        return self._read(bound)

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        """Send a command and wait for its reply."""
        return self.finish(self.begin(op, **args))

    def stun(
        self, host: str, ports: Sequence[int], timeout: float = 1.0
    ) -> list[tuple[str, int] | None]:
        """STUN Binding from this socket to each ``host:port``; the mapped address per
        port, None where no answer came within ``timeout`` s (requests are resent)."""
        reply = self.call("stun", host=host, ports=list(ports), timeout=timeout)
        return [None if m is None else (m[0], m[1]) for m in reply["mapped"]]

    def send(self, to: tuple[str, int], data: str) -> None:
        """Send one datagram (``data`` as UTF-8)."""
        self.call("send", to=list(to), data=data)

    def recv(self, timeout: float) -> tuple[tuple[str, int], str] | None:
        """The next datagram that is not a STUN response, or None after ``timeout`` s."""
        reply = self.call("recv", timeout=timeout)
        if reply.get("from") is None:
            return None
        return (reply["from"][0], reply["from"][1]), reply["data"]

    def punch_begin(self, to: tuple[str, int], timeout: float) -> float:
        """Start sending to ``to`` every 50 ms until a datagram from it arrives (then
        0.5 s more, so the peer hears us too) or ``timeout`` s pass."""
        return self.begin("punch", to=list(to), timeout=timeout)

    def tcp(self, host: str, port: int, timeout: float = 3.0) -> str | None:
        """Open (and close) a TCP connection; None on success, else the error text."""
        reply = self.call("tcp", host=host, port=port, timeout=timeout)
        return reply.get("failed")


def _agent(ip: str, port: int) -> None:  # pragma: no cover - runs in a namespace
    """The agent's main loop: one JSON command per stdin line, one reply per line."""
    sys.path.insert(0, str(ROOT))
    from p2pdist.wire.stun import (
        StunError,
        binding_request,
        new_transaction_id,
        parse_binding_response,
    )

    sock = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((ip, port))

    def reply(**fields: Any) -> None:
        print(json.dumps(fields), flush=True)

    def wait(deadline: float) -> tuple[bytes, tuple[str, int]] | None:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([sock], [], [], left)[0]:
            return None
        data, addr = sock.recvfrom(2048)
        return data, (addr[0], addr[1])

    reply(local=list(sock.getsockname()))
    for line in sys.stdin:
        cmd = json.loads(line)
        op, timeout = cmd["op"], float(cmd.get("timeout", 1.0))
        try:
            if op == "stun":
                txids = {p: new_transaction_id() for p in cmd["ports"]}
                mapped: dict[int, list[Any]] = {}
                deadline, resend = time.monotonic() + timeout, 0.0
                while len(mapped) < len(txids) and time.monotonic() < deadline:
                    if time.monotonic() >= resend:
                        for p, txid in txids.items():
                            if p not in mapped:
                                sock.sendto(binding_request(txid), (cmd["host"], p))
                        resend = time.monotonic() + 0.2
                    got = wait(min(deadline, resend))
                    if got is not None and got[1][1] in txids:
                        with contextlib.suppress(StunError):
                            mapped[got[1][1]] = list(
                                parse_binding_response(got[0], txids[got[1][1]])
                            )
                reply(mapped=[mapped.get(p) for p in cmd["ports"]])
            elif op == "send":
                sock.sendto(cmd["data"].encode(), tuple(cmd["to"]))
                reply(ok=True)
            elif op == "recv":
                deadline = time.monotonic() + timeout
                while (got := wait(deadline)) is not None and got[0][:2] == b"\x01\x01":
                    pass  # a late STUN response
                reply(
                    **(
                        {}
                        if got is None
                        else {"from": list(got[1]), "data": got[0].decode("utf-8", "replace")}
                    )
                )
            elif op == "punch":
                to = (cmd["to"][0], int(cmd["to"][1]))
                start = time.monotonic()
                deadline, heard, next_send = start + timeout, None, 0.0
                while time.monotonic() < deadline:
                    if time.monotonic() >= next_send:
                        sock.sendto(b"punch", to)
                        next_send = time.monotonic() + 0.05
                    got = wait(min(deadline, next_send))
                    if got is not None and got[1] == to and heard is None:
                        heard = time.monotonic() - start
                        deadline = min(deadline, time.monotonic() + 0.5)
                reply(heard=heard)
            elif op == "tcp":
                try:
                    socket.create_connection((cmd["host"], cmd["port"]), timeout=timeout).close()
                    reply(failed=None)
                except OSError as exc:
                    reply(failed=str(exc) or type(exc).__name__)
            else:
                reply(error=f"unknown op {op!r}")
        except Exception as exc:
            reply(error=f"{type(exc).__name__}: {exc}")


if __name__ == "__main__":  # pragma: no cover
    if len(sys.argv) == 4 and sys.argv[1] == "agent":
        _agent(sys.argv[2], int(sys.argv[3]))
    else:
        sys.exit("usage: natlab.py agent IP PORT")
