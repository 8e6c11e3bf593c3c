"""An in-memory relay for tests: paths that satisfy :class:`p2pdist.transport.paths.Relay`.

A :class:`FakeRelayHub` forwards datagrams between the :class:`FakeRelayPath` objects
attached to it, by endpoint id, on the next event-loop iteration (never re-entrantly),
like a relay that authenticated every client. A datagram for an id that is not attached
is answered with ``on_peer_gone(id)`` to the sender, as the real relay's PEER_GONE.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from p2pdist.errors import UsageError
from p2pdist.identity import EndpointId

__all__ = ["FakeRelayHub", "FakeRelayPath"]


class FakeRelayPath:
    """One client's session to a :class:`FakeRelayHub`."""

    def __init__(self, hub: FakeRelayHub, endpoint_id: EndpointId) -> None:
        self._hub = hub
        self._id = endpoint_id
        self.on_datagram: Callable[[EndpointId, bytes], None] | None = None
        self.on_peer_gone: Callable[[EndpointId], None] | None = None
        self.on_datagram_size: Callable[[int], None] | None = None
        self.max_datagram = hub.max_datagram
        self.sent = 0
        self.received = 0
        self.closed = False

    @property
    def endpoint_id(self) -> EndpointId:
        """Our endpoint id."""
        return self._id

    def send(self, dst: EndpointId, datagram: bytes) -> None:
        """Forward ``datagram`` to ``dst`` (dropped once this path is closed)."""
        if len(datagram) > self.max_datagram:
            raise UsageError(f"datagram of {len(datagram)} bytes exceeds {self.max_datagram}")
        if self.closed:
            return
        self.sent += 1
        self._hub.forward(self, dst, bytes(datagram))

    async def close(self) -> None:
        """Leave the hub."""
        self.closed = True
        self._hub.detach(self._id)

    def deliver(self, src: EndpointId, datagram: bytes) -> None:
        """Called by the hub."""
        if self.closed or self.on_datagram is None:
            return
        self.received += 1
        self.on_datagram(src, datagram)


class FakeRelayHub:
    """Forwards datagrams between attached paths by endpoint id."""

    def __init__(self, max_datagram: int = 16384) -> None:
        self.max_datagram = max_datagram
        self._paths: dict[EndpointId, FakeRelayPath] = {}
        self.forwarded = 0
        self.dropping = False
        """While True, every datagram is lost (an outage: the relay or its links down)."""
        self.dropped = 0

    def attach(self, endpoint_id: EndpointId) -> FakeRelayPath:
        """A new session for ``endpoint_id`` (replacing an older one)."""
        path = FakeRelayPath(self, endpoint_id)
        self._paths[endpoint_id] = path
        return path

    def detach(self, endpoint_id: EndpointId) -> None:
        """Drop ``endpoint_id``'s session: it neither sends nor receives any more."""
        path = self._paths.pop(endpoint_id, None)
        if path is not None:
            path.closed = True

    def forward(self, src: FakeRelayPath, dst: EndpointId, datagram: bytes) -> None:
        """Deliver on the next loop iteration, or tell the sender ``dst`` is gone."""
        if self.dropping:
            self.dropped += 1
            return
        loop = asyncio.get_running_loop()
        target = self._paths.get(dst)
        if target is None:
            if src.on_peer_gone is not None:
                loop.call_soon(src.on_peer_gone, dst)
            return
        self.forwarded += 1
        loop.call_soon(target.deliver, src.endpoint_id, datagram)
