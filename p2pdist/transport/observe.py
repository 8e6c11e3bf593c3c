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
from collections.abc import Callable, Hashable, Sequence

from ..wire.stun import StunError, binding_request, new_transaction_id, parse_binding_response
from .paths import UdpAddress

__all__ = ["StunProbe", "mapping_behaviour"]

FIRST_RETRY = 0.1
"""Seconds before the first resend; doubles after each."""


class StunProbe:
    """One round of Binding Requests from one socket to ``targets``."""

    def __init__(self, targets: Sequence[UdpAddress]) -> None:
        self.targets = list(targets)
        self.answers: list[UdpAddress | None] = [None] * len(self.targets)
        """Our address as each target saw it (None: no answer yet)."""
        self._txids = {new_transaction_id(): i for i in range(len(self.targets))}
        self._all_in = asyncio.Event()

    def on_datagram(self, data: bytes) -> bool:
        """Take a STUN message that arrived on the socket; True if it answered us."""
        txid = bytes(data[8:20])
        i = self._txids.get(txid)
        if i is None or self.answers[i] is not None:
            return False
        try:
            self.answers[i] = parse_binding_response(data, txid)
        except StunError:
            return False
        if all(a is not None for a in self.answers):
            self._all_in.set()
        return True

    async def run(
        self, send: Callable[[bytes, UdpAddress], None], timeout: float
    ) -> list[UdpAddress | None]:
        """Send (and resend) the requests until every target answered or ``timeout``
        seconds passed; returns :attr:`answers`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        delay = FIRST_RETRY
        while self.targets:
            for txid, i in self._txids.items():
                if self.answers[i] is None:
                    send(binding_request(txid), self.targets[i])
            left = deadline - loop.time()
            if left <= 0:
                break
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(delay, left)):
                    await self._all_in.wait()
            if self._all_in.is_set() or loop.time() >= deadline:
                break  # no resend whose answer nobody would wait for
            delay *= 2
        return self.answers


def mapping_behaviour(answers: Sequence[Hashable | None], local: Hashable | None = None) -> str:
    """``none (public address)`` (every target saw ``local``, the socket's own address:
    no NAT), ``endpoint-independent`` (one mapped address for every target),
    ``endpoint-dependent`` ("symmetric": one per target), ``no UDP`` (no answer at all)
    or ``unknown`` (fewer than two answers, e.g. a relay with one observation port)."""
    seen = [a for a in answers if a is not None]
    if not seen:
        return "no UDP" if answers else "unknown"
    if len(seen) < 2:
        return "unknown"
    if len(set(seen)) > 1:
        return "endpoint-dependent"
    return "none (public address)" if seen[0] == local else "endpoint-independent"
