"""Endpoint identity: Ed25519 secret keys and the endpoint ids (public keys) peers are named by.

An :class:`EndpointId` is the 32-byte Ed25519 public key. Its text form is 52 lowercase
RFC 4648 base32 characters (no padding) and round-trips exactly; :meth:`EndpointId.short`
gives the first 10 characters for logs.

:meth:`SecretKey.from_seed` derives one key per rank with HKDF-SHA256. The seed is a
**shared secret**: anyone who knows it can derive every rank's secret key and act as any
rank. Use a long random seed (``p2pdist keygen --seed`` prints one) and keep it like a password.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import errno
import functools
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from .errors import KeyFileError, UsageError

__all__ = ["EndpointId", "SecretKey", "check_seed", "derive_endpoint_ids", "iter_endpoint_ids"]

ID_LEN = 32
TEXT_LEN = 52
SHORT_LEN = 10
_SEED_SALT = b"p2pdist/v1/seed-salt"
_SEED_INFO = b"p2pdist/v1/rank-endpoint-key/"
MIN_SEED_BYTES = 8

_P = 2**255 - 19
_D = -121665 * pow(121666, _P - 2, _P) % _P  # edwards25519: -x^2 + y^2 = 1 + d x^2 y^2


def _jacobi(a: int, n: int) -> int:
    """The Jacobi symbol (a/n) for odd n > 0: for a prime n, 1 when a is a non-zero
    square mod n, -1 when it is not (four times faster here than Euler's criterion,
    a 255-bit ``pow``)."""
    a %= n
    result = 1
    while a:
        while not a & 1:
            a >>= 1
            if n & 7 in (3, 5):
                result = -result
        a, n = n, a
        if a & 3 == 3 and n & 3 == 3:
            result = -result
        a %= n
    return result if n == 1 else 0


def _weak_key_reason(raw: bytes) -> str | None:
    """Why the encoded point ``raw`` must not be an endpoint id, or None.

    A point of small order (the 8 points P with [8]P = 0) has signatures that verify
    without any secret: with R = 0 and S = 0, the check [S]B = R + [k]A holds whenever
    [k]A = 0, always for the identity and for one message in eight otherwise. No key
    made by :class:`SecretKey` is such a point, so refusing them costs honest peers
    nothing and means an id is only ever learned from a proof its owner made.
    A non-canonical encoding (y >= p) names a point that also has a canonical one.

    The y coordinate of 2P depends on y alone (x^2 follows from y by the curve
    equation), so three doublings of y = Y/Z tell whether [8]P is the identity (y = 1),
    in projective form to need no inversion.
    """
    y = int.from_bytes(raw, "little") & ((1 << 255) - 1)
    if y >= _P:
        return "a non-canonical encoding"
    # A y whose x^2 = num/den has no square root names no point (OpenSSL loads it all
    # the same, and it fails later, vaguely): num*den must be a square mod p.
    num, den = (y * y - 1) % _P, (_D * y * y + 1) % _P
    if num and _jacobi(num * den % _P, _P) != 1:
        return "not a point of the curve"
    big_y, z = y, 1
    for _ in range(3):
        yy, zz = big_y * big_y % _P, z * z % _P
        num, den = yy - zz, _D * yy + zz  # x^2 = num / den
        big_y, z = (yy * den + num * zz) % _P, (2 * zz * den + num * zz - yy * den) % _P
        if z == 0:  # never for a point of the curve
            return "not a point of the curve"
    return "a point of small order" if big_y == z else None


def exposed_key_file(path: Path, mode: int) -> str | None:
    """``"<path> is accessible by group or others (mode ...); run: chmod 600 <path>"``
    when a private key file of that ``st_mode`` is not private to its owner (or
    ``"<path> is a directory, not a file"``: chmod advice would be wrong there; a pipe,
    ``--key <(vault read ...)``, is read as a file), else None."""
    if stat.S_ISDIR(mode):
        return f"{path} is a directory, not a file"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return f"{path} is a device, not a file"
    if not mode & (stat.S_IRWXG | stat.S_IRWXO):
        return None
    return (
        f"{path} is accessible by group or others "
        f"(mode {stat.S_IMODE(mode):04o}); run: chmod 600 {path}"
    )


def _write_private(path: Path, data: bytes) -> None:
    """Create ``path`` (never an existing file, nor through a symbolic link: O_EXCL) with
    mode 0600 whatever the umask, write ``data`` and flush it to disk. A write that
    fails (a full disk) removes the file it created."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o600)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            path.unlink()
        raise


def _place_private(path: Path, data: bytes, *, replace: bool) -> None:
    """Put ``data`` at ``path`` whole or not at all: written to a new private file
    beside it (:func:`_write_private`), which then takes the path. ``replace``: renamed
    over it (an existing file is never written into, a symbolic link is replaced, not
    followed); else hard-linked into place, atomic and never over an existing file or
    link (FileExistsError), so a crash mid-write leaves no empty key there for the next
    start to refuse (where the file system has no hard links, ``path`` is written
    directly). The new file is removed whatever happens, a Ctrl-C too."""
    fresh = _beside(path)
    try:
        _write_private(fresh, data)
        if replace:
            os.replace(fresh, path)
        else:
            try:
                os.link(fresh, path, follow_symlinks=False)
            except OSError as exc:
                if exc.errno not in _NO_HARD_LINKS:
                    raise
                _write_private(path, data)
    finally:
        with contextlib.suppress(OSError):
            fresh.unlink()
    _sync_directory(path.parent)


_NO_HARD_LINKS = frozenset({errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP})
"""What link() says on a file system without hard links (vfat, some FUSE mounts)."""


def _beside(path: Path) -> Path:
    """A fresh hidden name in ``path``'s directory, for a file that becomes ``path``."""
    return path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")


def _sync_directory(path: Path) -> None:
    """Make a rename in directory ``path`` last through a crash (POSIX; best effort)."""
    with contextlib.suppress(OSError, AttributeError):
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class EndpointId:
    """A peer's identity: its Ed25519 public key (32 bytes)."""

    __slots__ = ("_bytes", "_key")

    def __init__(self, raw: bytes) -> None:
        if not isinstance(raw, bytes | bytearray):
            raise UsageError(f"an endpoint id is {ID_LEN} bytes, got {type(raw).__name__}")
        if len(raw) != ID_LEN:
            raise UsageError(f"an endpoint id is {ID_LEN} bytes, got {len(raw)}")
        self._bytes = bytes(raw)
        if (weak := _weak_key_reason(self._bytes)) is not None:
            raise UsageError(f"not an Ed25519 public key: {weak}")
        try:
            self._key = Ed25519PublicKey.from_public_bytes(self._bytes)
        except ValueError as exc:
            raise UsageError(f"not an Ed25519 public key: {exc}") from exc

    @classmethod
    def _of(cls, public: Ed25519PublicKey) -> EndpointId:
        """The id of a key derived from a private key (always a point of the prime-order
        subgroup: the checks of ``__init__``, some 50 us, are skipped)."""
        eid = cls.__new__(cls)
        eid._bytes, eid._key = public.public_bytes_raw(), public
        return eid

    @classmethod
    def parse(cls, text: str) -> EndpointId:
        """Parse the 52-character text form; raises :class:`UsageError` with the reason."""
        if not isinstance(text, str):
            raise UsageError(f"endpoint id text must be str, got {type(text).__name__}")
        t = text.strip()
        if len(t) != TEXT_LEN:
            raise UsageError(
                f"endpoint id must be {TEXT_LEN} base32 characters, got {len(t)}: {t[:60]!r}"
            )
        try:
            raw = base64.b32decode(t.upper() + "====")
        except (binascii.Error, ValueError) as exc:
            raise UsageError(f"endpoint id {t!r} is not valid base32 (a-z, 2-7)") from exc
        eid = cls(raw)
        if str(eid) != t.lower():
            # 52 characters carry 260 bits for 256: the last 4 must be zero, so that every
            # id has exactly one text form.
            raise UsageError(f"endpoint id {t!r} is not canonical (did you mean {eid}?)")
        return eid

    def __bytes__(self) -> bytes:
        return self._bytes

    def __str__(self) -> str:
        return base64.b32encode(self._bytes).decode("ascii").rstrip("=").lower()

    def __repr__(self) -> str:
        return f"EndpointId({self})"

    def short(self) -> str:
        """First characters of the text form, for log lines and error messages."""
        return str(self)[:SHORT_LEN]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EndpointId) and other._bytes == self._bytes

    def __hash__(self) -> int:
        return hash(self._bytes)

    def verify(self, signature: bytes, message: bytes) -> bool:
        """True when ``signature`` is this endpoint's Ed25519 signature of ``message``."""
        try:
            self._key.verify(signature, message)
        except InvalidSignature:
            return False
        return True

    def public_key(self) -> Ed25519PublicKey:
        """The ``cryptography`` public key object."""
        return self._key


def check_seed(seed: str | bytes) -> bytes:
    """A group seed's bytes (UTF-8 for a str); UsageError when it is no str or bytes or
    shorter than :data:`MIN_SEED_BYTES`."""
    if isinstance(seed, str):
        seed_bytes = seed.encode("utf-8")
    elif isinstance(seed, bytes | bytearray | memoryview):
        seed_bytes = bytes(seed)
    else:  # bytes(10) would silently be ten zero bytes
        raise UsageError(f"seed must be str or bytes, got {type(seed).__name__}")
    if len(seed_bytes) < MIN_SEED_BYTES:
        raise UsageError(f"seed must be at least {MIN_SEED_BYTES} bytes; use a long random secret")
    return seed_bytes


@functools.lru_cache(maxsize=1024)
def endpoint_id_of(raw: bytes) -> EndpointId:
    """``EndpointId(raw)``, cached (the most recent 1024): for ids parsed from every
    received datagram, where building an Ed25519 key object each time would cost more
    than the datagram's own handling."""
    return EndpointId(raw)


class SecretKey:
    """An Ed25519 secret key. Its repr never shows key material."""

    __slots__ = ("_key", "_public")

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._key = key
        self._public = EndpointId._of(key.public_key())

    @classmethod
    def generate(cls) -> SecretKey:
        """A fresh random key."""
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_bytes(cls, raw: bytes) -> SecretKey:
        """Load the 32-byte Ed25519 private seed."""
        if len(raw) != ID_LEN:
            raise UsageError(f"an Ed25519 secret key is {ID_LEN} bytes, got {len(raw)}")
        return cls(Ed25519PrivateKey.from_private_bytes(bytes(raw)))

    @classmethod
    def from_seed(cls, seed: str | bytes, rank: int) -> SecretKey:
        """Derive rank ``rank``'s key from a group seed with HKDF-SHA256.

        The seed is a shared secret: whoever holds it can derive every rank's key.
        """
        seed_bytes = check_seed(seed)
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < 1 << 64:
            raise UsageError(f"rank must be a non-negative int below 2**64, got {rank!r}")
        hkdf = HKDF(
            algorithm=hashes.SHA256(),
            length=ID_LEN,
            salt=_SEED_SALT,
            info=_SEED_INFO + rank.to_bytes(8, "big"),
        )
        return cls.from_bytes(hkdf.derive(seed_bytes))

    @property
    def endpoint_id(self) -> EndpointId:
        """The public identity of this key."""
        return self._public

    def sign(self, message: bytes) -> bytes:
        """Ed25519 signature (64 bytes) of ``message``."""
        return self._key.sign(message)

    def private_key(self) -> Ed25519PrivateKey:
        """The ``cryptography`` private key object (handle with care)."""
        return self._key

    def __repr__(self) -> str:
        return f"SecretKey(endpoint_id={self._public.short()}…, secret=<hidden>)"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SecretKey) and other._public == self._public

    def __hash__(self) -> int:
        return hash(self._public)

    def to_pem(self) -> bytes:
        """The key as unencrypted PKCS#8 PEM, the format of :meth:`save` (handle with care)."""
        return self._key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    def save(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> None:
        """Write the key as PKCS#8 PEM, in a file created with mode 0600: whole or not
        at all (written beside ``path``, then linked into place).

        With ``overwrite``, the key goes to a new file beside ``path`` that then replaces
        it: the old file is never written into, so a reader who opened it while it was
        readable does not see the new key, and a symbolic link at ``path`` is replaced,
        not followed. That needs write permission on the directory, and ``path`` must
        not be a mount point of its own (a file bind-mounted into a container)."""
        p = Path(path)
        try:
            _place_private(p, self.to_pem(), replace=overwrite)
        except FileExistsError as exc:
            if p.is_symlink() and not p.exists():  # (exists() follows it)
                raise KeyFileError(
                    f"key file {p} is a symbolic link to {os.readlink(p)}, which does not "
                    "exist (the link exists: fix it, or remove it to have the key written "
                    "there)"
                ) from exc
            raise KeyFileError(f"{p} exists; pass overwrite=True to replace it") from exc
        except OSError as exc:  # no such directory, a directory, no permission, ...
            raise KeyFileError(f"cannot write key file {p}: {exc.strerror or exc}") from exc

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> SecretKey:
        """Read a key written by :meth:`save`; refuses files readable by group or others."""
        p = Path(path)
        try:
            st = p.stat()
        except FileNotFoundError as exc:
            raise KeyFileError(f"key file {p} does not exist") from exc
        except OSError as exc:
            raise KeyFileError(f"cannot read key file {p}: {exc}") from exc
        problem = exposed_key_file(p, st.st_mode)
        if problem is not None and not stat.S_ISREG(st.st_mode):  # a directory, a device
            raise KeyFileError(f"key file {problem}")
        try:
            with p.open("rb") as f:
                # The mode of the file read, not of the path a moment before.
                problem = exposed_key_file(p, os.fstat(f.fileno()).st_mode)
                data = f.read(_KEY_FILE_MAX + 1)  # a key is some 120 bytes: not a log
        except OSError as exc:
            raise KeyFileError(f"cannot read key file {p}: {exc}") from exc
        if len(data) > _KEY_FILE_MAX:
            raise KeyFileError(f"key file {p} is not a key file (over {_KEY_FILE_MAX} bytes)")
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
            raise KeyFileError(f"key file {p} is not an unencrypted PEM private key") from exc
        if not isinstance(key, Ed25519PrivateKey):
            raise KeyFileError(f"key file {p} holds a {type(key).__name__}, not an Ed25519 key")
        blocks = data.count(b"-----BEGIN ")
        if blocks > 1:  # (keygen >> FILE twice): which one is meant cannot be told
            raise KeyFileError(f"key file {p} holds {blocks} PEM blocks, not one key")
        # A key readable by others, once the file is known to be a key: a wrong file
        # was asked to be made private first, and only then said to be no key.
        if problem is not None:
            raise KeyFileError(f"key file {problem}")
        return cls(key)


_KEY_FILE_MAX = 64 * 1024
"""The most :meth:`SecretKey.load` reads (a PEM Ed25519 key is about 120 bytes)."""


def derive_endpoint_ids(seed: str | bytes, world: int) -> list[EndpointId]:
    """Every rank's endpoint id for a seed-derived group of ``world`` ranks."""
    return list(iter_endpoint_ids(seed, world))


def iter_endpoint_ids(seed: str | bytes, world: int) -> Iterator[EndpointId]:
    """:func:`derive_endpoint_ids` one rank at a time (``world`` is checked at once)."""
    if world < 1:
        raise UsageError(f"world must be >= 1, got {world}")
    return (SecretKey.from_seed(seed, r).endpoint_id for r in range(world))
