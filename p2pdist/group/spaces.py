"""Which channel spaces a rank's sub-groups use, and the bookkeeping that lets concurrent
splits agree on spaces that never collide (sans-I/O; :meth:`Group.split` does the
exchanges).

A sub-group takes two spaces, an even one for its collectives and the next for its point
to point messages. Agreeing on one takes two rounds over the parent group:

1. every rank proposes a space it holds for this split (:meth:`SpaceBook.propose`); each
   colour's members take the largest proposal among them;
2. every member *claims* that space (:meth:`SpaceBook.claim`): the claim fails when a
   sub-group of this rank already uses it, or another unfinished split here holds it.
   The ranks exchange whether their claim held; if any failed, all try again with
   proposals above the largest one seen.

Two splits can never end with the same space on a connection both use: both ends of it
claimed the space for each split, and a rank's claims are made one at a time, so the
second claim there would have found the space held or taken, unless the first split
failed its round and let it go.
"""

from __future__ import annotations

__all__ = ["SpaceBook"]


class SpaceBook:
    """Channel spaces for sub-groups on one rank (kept by the root group): the ones its
    sub-groups use, and the ones unfinished splits hold (keyed by a token per split)."""

    def __init__(self, first: int) -> None:
        self.next = first
        """The lowest space this rank has not proposed yet (always even)."""
        self._taken: set[int] = set()
        self._held: dict[int, object] = {}

    def propose(self, token: object, at_least: int = 0) -> int:
        """A space for the split ``token`` to propose (held for it until released): the
        lowest even one from :attr:`next` and ``at_least`` on that nothing here uses."""
        space = max(self.next, at_least + at_least % 2)
        while space in self._taken or space in self._held:
            space += 2
        self._held[space] = token
        self.next = space + 2
        return space

    def taken(self, space: int) -> bool:
        """Whether a sub-group here was made on ``space`` (it stays taken once closed)."""
        return space in self._taken

    def claim(self, space: int, token: object) -> bool:
        """Hold ``space`` for the split ``token`` unless a sub-group here uses it or
        another unfinished split holds it (then False)."""
        if space in self._taken or self._held.get(space, token) is not token:
            return False
        self._held[space] = token
        return True

    def commit(self, space: int, token: object) -> None:
        """The split ``token`` ended with a sub-group on ``space``: it is taken for good,
        and whatever else the split held is let go."""
        self.release(token)
        self._taken.add(space)
        self.next = max(self.next, space + 2)

    def release(self, token: object) -> None:
        """Let go of every space the split ``token`` holds."""
        for space in [s for s, t in self._held.items() if t is token]:
            del self._held[space]
