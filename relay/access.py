"""Access control: open, an allowlist of endpoint ids (reloaded when its file changes),
a shared token, or both.

The allowlist file holds one endpoint id (52 base32 characters) per line; blank lines
and everything after ``#`` are ignored. The relay checks the file's modification time,
size and inode at most once per ``check_interval`` seconds, on each authentication, and
reloads it when they changed; :meth:`Allowlist.refresh` with ``force=True`` (SIGHUP)
reloads unconditionally. A file that becomes unreadable or malformed keeps the last good
list in force and is logged once (again only when the file changes, or on SIGHUP). A file
that parses is taken as it is, even a truncated one (an empty file refuses everyone), so
editors should write a temporary file and rename it over the allowlist; a reload that
empties the list, or shrinks it by more than half, is logged as a warning. A UTF-8 byte
order mark at the start is ignored.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from p2pdist.errors import UsageError
from p2pdist.identity import EndpointId
from p2pdist.wire.relay import BAD_TOKEN_TEXT, CREDENTIAL_REFUSALS, NOT_ALLOWED_TEXT

from .logfmt import kv

__all__ = ["AccessPolicy", "Allowlist", "AllowlistError", "Refusal", "parse_allowlist"]

log = logging.getLogger(__name__)


_MISSING: tuple[int, ...] = (-1,)
"""The signature remembered for a file that cannot even be stat'ed."""


class AllowlistError(ValueError):
    """The allowlist file is malformed; the message names the line."""


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a client may not use the relay: a metric label and the ERROR text."""

    reason: str
    message: str


BAD_TOKEN = Refusal(CREDENTIAL_REFUSALS[BAD_TOKEN_TEXT], BAD_TOKEN_TEXT)
NOT_ALLOWED = Refusal(CREDENTIAL_REFUSALS[NOT_ALLOWED_TEXT], NOT_ALLOWED_TEXT)


def parse_allowlist(text: str, source: str) -> frozenset[bytes]:
    """The raw ids listed in ``text``; AllowlistError naming ``source`` and the line."""
    ids: set[bytes] = set()
    for lineno, line in enumerate(text.splitlines(), 1):
        entry = line.split("#", 1)[0].strip()
        if not entry:
            continue
        try:
            ids.add(bytes(EndpointId.parse(entry)))
        except UsageError as exc:
            raise AllowlistError(f"{source}:{lineno}: {exc}") from None
    return frozenset(ids)


class Allowlist:
    """The set of allowed endpoint ids, backed by a file."""

    def __init__(self, path: Path, *, check_interval: float = 1.0) -> None:
        self.path = path
        self._interval = check_interval
        self._ids: frozenset[bytes] = frozenset()
        self._signature: tuple[int, ...] | None = None
        self._failed: tuple[int, ...] | None = None
        self._checked: float | None = None
        self._load(self._stat())  # at start-up a bad file is an error, not a warning

    def _unreadable(self, exc: Exception) -> AllowlistError:
        return AllowlistError(f"cannot read allowlist {self.path}: {exc}")

    def _stat(self) -> tuple[int, ...]:
        """The file's (mtime, ctime, size, inode, device): a chmod that makes it readable
        counts as a change; AllowlistError when it cannot be stat'ed."""
        try:
            st = os.stat(self.path)
        except OSError as exc:
            raise self._unreadable(exc) from None
        return (st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino, st.st_dev)

    def _load(self, signature: tuple[int, ...]) -> None:
        """Read and parse the file whose stat was ``signature`` (taken before reading, so
        a change during the read shows as a changed file at the next check)."""
        try:
            text = self.path.read_text(encoding="utf-8-sig")  # a BOM is not an id
        except (OSError, UnicodeDecodeError) as exc:
            raise self._unreadable(exc) from None
        ids = parse_allowlist(text, str(self.path))
        previous = None if self._signature is None else len(self._ids)
        self._ids, self._signature, self._failed = ids, signature, None
        log.info(kv("allowlist_loaded", path=self.path, entries=len(ids)))
        if not ids:
            log.warning(
                kv(
                    "allowlist_empty",
                    path=self.path,
                    previous=previous,
                    hint="every client is refused; was the file cut short?",
                )
            )
        elif previous is not None and len(ids) * 2 < previous:
            log.warning(kv("allowlist_shrunk", path=self.path, entries=len(ids), previous=previous))

    def refresh(self, now: float, *, force: bool = False) -> None:
        """Reload the file if it changed (checked at most every ``check_interval`` s).

        A file that fails to load is logged once: its signature is remembered, and it is
        tried (and logged) again only when it changes, or on ``force``."""
        if not force and self._checked is not None and now - self._checked < self._interval:
            return
        self._checked = now
        signature = _MISSING  # what a file that cannot be stat'ed is remembered as
        try:
            signature = self._stat()
            if not force and signature in (self._signature, self._failed):
                return
            self._load(signature)
        except AllowlistError as exc:
            if force or signature != self._failed:
                log.error(kv("allowlist_reload_failed", error=exc, kept=len(self._ids)))
            self._failed = signature

    def __contains__(self, raw_id: bytes) -> bool:
        return raw_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)


WEAK_TOKEN_CHARS = 16
"""Tokens shorter than this are warned about (``token_weak``) when the relay starts: a
token can be tried online once per connection, so only a long random one is safe."""


class AccessPolicy:
    """Who may use the relay: everyone, listed ids, token holders, or listed token holders."""

    def __init__(self, allowlist: Allowlist | None = None, token: str | None = None) -> None:
        self.allowlist = allowlist
        # Digests compared, not the tokens: equal lengths, so not even the token's length
        # shows in the comparison's time.
        self._token = hashlib.sha256(token.encode("utf-8")).digest() if token else None

    @property
    def mode(self) -> str:
        """``open``, ``allowlist``, ``token`` or ``allowlist+token`` (for logs)."""
        # ``is not None``: an empty Allowlist is falsy (len 0) but still refuses everyone.
        parts = [
            n for n, v in (("allowlist", self.allowlist), ("token", self._token)) if v is not None
        ]
        return "+".join(parts) or "open"

    def check(self, raw_id: bytes, token: bytes, now: float) -> Refusal | None:
        """None when the (already authenticated) endpoint may use the relay. The list
        comes first: an unlisted endpoint (ids cost nothing) must not learn from the
        refusal whether a token it tries is right."""
        if self.allowlist is not None:
            self.allowlist.refresh(now)
            if raw_id not in self.allowlist:
                return NOT_ALLOWED
        if self._token is not None and not hmac.compare_digest(
            hashlib.sha256(token).digest(), self._token
        ):
            return BAD_TOKEN
        return None

    def reload(self, now: float) -> None:
        """Re-read the allowlist now (SIGHUP)."""
        if self.allowlist is not None:
            self.allowlist.refresh(now, force=True)
