"""Where do the relay's observation ports see one of our UDP sockets? (STUN, RFC 8489)

:class:`StunProbe` sends a Binding Request to each observation port (resent with
exponential backoff until answered or out of time) and collects the answers, which the
socket's owner feeds in (:meth:`StunProbe.on_datagram`): the hole puncher over the
transport's shared socket, ``p2pdist doctor`` over a socket of its own.
:func:`mapping_behaviour` reads the NAT's mapping type off the answers.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Collection, Hashable, Sequence

from ..wire.stun import StunError, binding_request, new_transaction_id, parse_binding_response
from .paths import UdpAddress, worth_probing

__all__ = ["StunProbe", "mapping_behaviour"]

FIRST_RETRY = 0.1
"""Seconds before the first resend; doubles after each."""
FAMILY_GRACE = 0.3
"""Seconds the IPv6 targets still get once every IPv4 target has answered (a relay whose
name has an IPv6 address its observation ports do not answer on, or an IPv6 path that
drops UDP, must not hold up every observation). IPv4, the mapping most peers need,
always gets the whole timeout."""


def _possible(addr: UdpAddress) -> bool:
    """Whether a mapped address is one a socket can have (a candidate to offer): a port,
    and an address a peer could probe (loopback too: a relay on this host sees us there)."""
    return 0 < addr[1] < 65536 and worth_probing(addr[0], on_loopback=True)


class StunProbe:
    """One round of Binding Requests from one socket to ``targets`` (IPv4, IPv6 or both:
    once every IPv4 target has answered, the IPv6 ones get :data:`FAMILY_GRACE`)."""

    def __init__(self, targets: Sequence[UdpAddress]) -> None:
        self.targets = list(targets)
        self.answers: list[UdpAddress | None] = [None] * len(self.targets)
        """Our address as each target saw it (None: no answer yet)."""
        self._txids = {new_transaction_id(): i for i in range(len(self.targets))}
        self._all_in = asyncio.Event()
        self._ipv4_in = asyncio.Event()
        """Set once every IPv4 target has answered (IPv6 ones then get the grace)."""
        self._has_ipv4 = any(":" not in t[0] for t in self.targets)

    def on_datagram(self, data: bytes) -> bool:
        """Take a STUN message that arrived on the socket; True if it answered us. An
        answer naming an address no socket can have (port 0, unspecified, multicast) is
        none. (Its source is not checked against the target: a relay on several
        addresses answers from whichever its routing picks; the 96-bit transaction id
        is what an answer must know.)"""
        txid = bytes(data[8:20])
        i = self._txids.get(txid)
        if i is None or self.answers[i] is not None:
            return False
        try:
            mapped = parse_binding_response(data, txid)
        except StunError:
            return False
        if not _possible(mapped):
            return False
        self.answers[i] = mapped
        if all(a is not None for a in self.answers):
            self._all_in.set()
        ipv4 = [a for t, a in zip(self.targets, self.answers, strict=True) if ":" not in t[0]]
        if ipv4 and all(a is not None for a in ipv4):
            self._ipv4_in.set()
        return True

    async def run(
        self, send: Callable[[bytes, UdpAddress], None], timeout: float
    ) -> list[UdpAddress | None]:
        """Send (and resend) the requests until every target answered or ``timeout``
        seconds passed (less for IPv6 once IPv4 is in: see the class); returns
        :attr:`answers`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        delay = FIRST_RETRY
        grace_set = False
        while self.targets:
            for txid, i in self._txids.items():
                if self.answers[i] is None:
                    send(binding_request(txid), self.targets[i])
            resend_at = loop.time() + delay
            while not self._all_in.is_set():
                if self._ipv4_in.is_set() and not grace_set:
                    grace_set = True
                    deadline = min(deadline, loop.time() + FAMILY_GRACE)
                wake = min(resend_at, deadline) - loop.time()
                if wake <= 0:
                    break
                # (Without IPv4 targets, only every answer ends the wait: an IPv6-only
                # probe answered at once waited for its next resend.)
                waiter = self._all_in if grace_set or not self._has_ipv4 else self._ipv4_in
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wake):
                        await waiter.wait()
            if self._all_in.is_set() or loop.time() >= deadline:
                break  # no resend whose answer nobody would wait for
            delay *= 2
        return self.answers


def mapping_behaviour(answers: Sequence[Hashable | None], own: Collection[Hashable] = ()) -> str:
    """``none (public address)`` (every target saw one of ``own``, the socket's own
    addresses: no NAT), ``endpoint-independent`` (one mapped address for every target),
    ``endpoint-dependent`` ("symmetric": one per target), ``no UDP`` (no answer at all)
    or ``unknown`` (fewer than two answers, e.g. a relay with one observation port).
    Give the answers of one address family: each family is mapped on its own."""
    seen = [a for a in answers if a is not None]
    if not seen:
        return "no UDP" if answers else "unknown"
    if len(seen) < 2:
        return "unknown"
    if len(set(seen)) > 1:
        return "endpoint-dependent"
    return "none (public address)" if seen[0] in own else "endpoint-independent"
