"""Run N local ranks of a command, wired together through ``P2PDIST_*`` variables.

``p2pdist launch -n 3 -- python train.py`` starts three copies of ``python train.py``.
Each child gets:

* ``P2PDIST_SEED`` - the group seed (random unless given), shared by all ranks;
* ``P2PDIST_RANK`` / ``P2PDIST_WORLD`` - its rank and the number of ranks;
* ``P2PDIST_PEERS`` - ``host:port`` of every rank, comma-separated, in rank order;
* ``P2PDIST_TLS`` - ``"1"``, or ``"0"`` with ``--plaintext``;

and loses ``P2PDIST_RELAY``, ``P2PDIST_LAN`` and ``P2PDIST_LISTEN`` from the launcher's
environment (the ranks are wired by ``P2PDIST_PEERS``, each listening on its own entry;
the launcher says so when it drops one).

Every line a child writes is echoed with a ``[rank R] `` prefix (stdout to stdout,
stderr to stderr). If a rank fails, the others are stopped (SIGTERM, then SIGKILL
after :attr:`LaunchConfig.grace_s`) and the launcher exits with the failing code.
Each rank runs in its own session, and when the launcher ends (every rank done, one
failed, or a signal) it stops what is left of every rank's process group, so no
background child of a rank outlives the launch (unless it left the group: ``setsid``,
daemons). SIGINT,
SIGTERM, SIGHUP (a closed terminal) and SIGQUIT to the launcher stop every rank the same
way (SIGQUIT is passed on to the ranks first, with a grace period to dump), and the
launcher exits with 128 + the signal's number. So does a reader of the launcher's output
that goes away (``p2pdist launch ... | head``): the ranks are stopped and the launcher
exits 141, as a command killed by SIGPIPE. A terminal that hung up does not stop the
teardown: output that cannot be written is dropped. Output is written by a thread
(:mod:`p2pdist.launch_output`), so a blocked output (a paused terminal) does not keep the
launcher from acting on signals; and a launcher killed with SIGKILL has its ranks
stopped by its guard (:mod:`p2pdist.launch_guard`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import itertools
import os
import secrets
import signal
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO, cast

from .errors import UsageError
from .identity import check_seed
from .launch_guard import Guard, live_groups
from .launch_output import OutputWriter
from .settings import env_flag

__all__ = [
    "CommandNotStarted",
    "ENV_PEERS",
    "ENV_LAN",
    "ENV_LISTEN",
    "ENV_RANK",
    "ENV_RELAY",
    "ENV_SEED",
    "ENV_TLS",
    "ENV_WORLD",
    "MAX_LOCAL_RANKS",
    "LaunchConfig",
    "LineSplitter",
    "RankExit",
    "exit_status",
    "launch",
    "pick_free_ports",
    "rank_env",
]

ENV_SEED = "P2PDIST_SEED"
ENV_RANK = "P2PDIST_RANK"
ENV_WORLD = "P2PDIST_WORLD"
ENV_PEERS = "P2PDIST_PEERS"
ENV_TLS = "P2PDIST_TLS"
ENV_RELAY = "P2PDIST_RELAY"
ENV_LAN = "P2PDIST_LAN"
ENV_LISTEN = "P2PDIST_LISTEN"
_NOT_PASSED_ON = (ENV_RELAY, ENV_LAN, ENV_LISTEN)
"""What would wire the ranks some other way than ``P2PDIST_PEERS`` (``Group.from_env``
refuses two ways), or make them all listen on one address."""

_READ_CHUNK = 65536


@dataclass(frozen=True)
class LaunchConfig:
    """What to launch and how.

    ``grace_s`` (seconds) is how long stopped ranks get between SIGTERM and SIGKILL;
    ``kill_wait_s`` (seconds) bounds the wait after SIGKILL; ``drain_s`` (seconds)
    bounds how long output is still read after the ranks have exited (a grandchild
    may hold a pipe open).
    """

    command: tuple[str, ...]
    nprocs: int
    host: str = "127.0.0.1"
    tls: bool = True
    seed: str | None = None
    grace_s: float = 3.0
    kill_wait_s: float = 2.0
    drain_s: float = 2.0

    def __post_init__(self) -> None:
        if not self.command:
            raise UsageError("launch needs a command after '--', e.g. -- python train.py")
        if not self.host.strip():  # every rank would fail on ":port" addresses
            raise UsageError("--host must name an address the ranks listen on")
        if not 1 <= self.nprocs <= MAX_LOCAL_RANKS:
            raise UsageError(
                f"the number of ranks (-n) must be 1 to {MAX_LOCAL_RANKS} on one machine "
                f"(each rank is a process with a TCP port), got {self.nprocs}"
            )
        if self.seed is not None:
            # What every rank's Group.from_seed would refuse, said once, before starting.
            try:
                check_seed(self.seed)
            except UsageError as exc:
                raise UsageError(f"--seed: {exc}") from None
        for name in ("grace_s", "kill_wait_s", "drain_s"):
            if getattr(self, name) < 0:
                raise UsageError(f"{name} must be >= 0 seconds")


@dataclass(frozen=True)
class RankExit:
    """How one rank ended: ``returncode`` as asyncio reports it (negative = signal)."""

    rank: int
    returncode: int

    @property
    def ok(self) -> bool:
        """Whether the rank exited with status 0."""
        return self.returncode == 0

    def describe(self) -> str:
        """A human sentence, e.g. ``rank 1 exited with code 3``."""
        if self.returncode < 0:
            return f"rank {self.rank} was killed by signal {_signal_name(-self.returncode)}"
        return f"rank {self.rank} exited with code {self.returncode}"


def _signal_name(signum: int) -> str:
    try:
        return f"{signal.Signals(signum).name} ({signum})"
    except ValueError:
        return str(signum)


def exit_status(returncode: int) -> int:
    """The launcher's exit status for a failed rank's ``returncode``.

    A positive code is passed through; death by signal ``s`` gives ``128 + s``.
    """
    if returncode < 0:
        return 128 + (-returncode)
    return returncode if returncode > 0 else 1


MAX_LOCAL_RANKS = 1024
"""Most ranks ``launch`` starts on one machine: each is a process with its own port, and
binding many thousands of ports at once slows to a crawl once the kernel's local port
range runs short."""


class CommandNotStarted(UsageError):
    """The ranks' command could not be started; ``exit_status`` is what a shell gives:
    127 when it is not found, 126 when it cannot be run (no permission, not a program),
    2 otherwise."""

    def __init__(self, command: str, exc: OSError) -> None:
        super().__init__(f"cannot start {command!r}: {exc.strerror or exc}")
        if isinstance(exc, FileNotFoundError):
            self.exit_status = 127
        elif isinstance(exc, PermissionError) or exc.errno == errno.ENOEXEC:
            self.exit_status = 126


_TOO_MANY_FILES = (errno.EMFILE, errno.ENFILE)


def _too_many_files(what: str, takes: str) -> UsageError:
    """The error for running out of file descriptors while the launcher does ``what``
    (it holds ``takes`` of them)."""
    return UsageError(
        f"cannot {what}: too many open files (the launcher holds {takes}; ulimit -n is "
        f"{_open_files_limit() or '?'}): start fewer ranks, or raise the limit"
    )


def pick_free_ports(host: str, count: int) -> list[int]:
    """``count`` distinct TCP ports on ``host`` that are free right now.

    All sockets are held open until every port is chosen, so the ports differ.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            s = socket.socket(family, socket.SOCK_STREAM)
            socks.append(s)
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in socks]
    except OSError as exc:
        if exc.errno in _TOO_MANY_FILES:  # not the host's fault
            raise _too_many_files(
                f"pick {count} ports", "one socket per rank while it picks"
            ) from exc
        raise UsageError(f"cannot bind a TCP port on {host!r}: {exc}") from exc
    finally:
        for s in socks:
            s.close()


_GROUP_POLL_S = 0.5
"""How often the launcher looks for ranks' process groups that have emptied."""
_STREAM_LIMIT = 1 << 16
"""The rank's output streams' buffer limit (asyncio's default; the pumps read chunks)."""


class _RankProtocol(asyncio.subprocess.SubprocessStreamProtocol):
    """A rank's subprocess protocol that tells when the process itself exited: not
    ``Process.wait()``, which returns only once every process holding its output pipes
    closed them too (a rank's helper in the background hid the rank's exit: its crash
    was blamed on another rank, or the launch waited as long as the helper ran)."""

    def __init__(self, exited: asyncio.Future[tuple[int, int]], order: itertools.count[int]):
        super().__init__(limit=_STREAM_LIMIT, loop=exited.get_loop())
        self.exited = exited
        """Resolves to (the order in which the launcher saw ranks exit, the status)."""
        self._order = order
        self._process: asyncio.SubprocessTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._process = cast(asyncio.SubprocessTransport, transport)

    def process_exited(self) -> None:
        super().process_exited()
        process = self._process
        code = process.get_returncode() if process is not None else None
        if not self.exited.done():
            self.exited.set_result((next(self._order), -1 if code is None else code))


def _format_peer(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def rank_env(
    base: Mapping[str, str], *, rank: int, world: int, seed: str, peers: Sequence[str], tls: bool
) -> dict[str, str]:
    """The environment for rank ``rank``: ``base`` plus the ``P2PDIST_*`` variables,
    without the relay URL, LAN flag or listen address that ``base`` may hold (the
    launched ranks reach each other at ``peers``, each listening on its own entry)."""
    env = {k: v for k, v in base.items() if k not in _NOT_PASSED_ON}
    env[ENV_SEED] = seed
    env[ENV_RANK] = str(rank)
    env[ENV_WORLD] = str(world)
    env[ENV_PEERS] = ",".join(peers)
    env[ENV_TLS] = "1" if tls else "0"
    return env


class LineSplitter:
    """Cuts a byte stream into lines (sans-I/O).

    :meth:`feed` returns the complete lines (with their ``\\n``); a partial line longer
    than ``max_line`` bytes is returned early so memory stays bounded. :meth:`flush`
    returns what is left at EOF.
    """

    def __init__(self, max_line: int = 1 << 20) -> None:
        self._buf = bytearray()
        self._max_line = max_line

    def feed(self, data: bytes) -> list[bytes]:
        """Add ``data``; return the lines it completed."""
        self._buf += data
        lines: list[bytes] = []
        start = 0
        while (nl := self._buf.find(b"\n", start)) >= 0:
            lines.append(bytes(self._buf[start : nl + 1]))
            start = nl + 1
        del self._buf[:start]
        if len(self._buf) >= self._max_line:
            lines.append(bytes(self._buf))
            self._buf.clear()
        return lines

    def flush(self) -> list[bytes]:
        """The unterminated tail, if any."""
        tail = bytes(self._buf)
        self._buf.clear()
        return [tail] if tail else []


def _prefixed(prefix: bytes, lines: list[bytes]) -> bytes:
    return b"".join(
        prefix + line if line.endswith(b"\n") else prefix + line + b"\n" for line in lines
    )


async def _pump(
    stream: asyncio.StreamReader, writer: OutputWriter, out: BinaryIO, prefix: bytes
) -> None:
    """Copy ``stream`` to ``out`` line by line, each line prefixed. When ``out``'s reader
    has gone away the copying goes on, into nothing, so that no rank blocks on a full
    pipe while it is being stopped."""
    splitter = LineSplitter()
    try:
        while chunk := await stream.read(_READ_CHUNK):
            if lines := splitter.feed(chunk):
                await writer.write(out, _prefixed(prefix, lines))
    finally:
        if tail := splitter.flush():
            writer.post(out, _prefixed(prefix, tail))


def _open_files_limit(at_least: int = 0) -> int | None:
    """The soft limit on open files, first raised towards ``at_least`` (each rank holds
    two pipes in the launcher) as far as the hard limit allows; None where the platform
    has no such limit."""
    try:
        import resource  # (POSIX only: the launcher's other parts run anywhere)
    except ImportError:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < at_least:
        top = max(soft, at_least if hard == resource.RLIM_INFINITY else min(at_least, hard))
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (top, hard))
            soft = top
    return soft


def _say(message: str) -> None:
    # After a hangup the terminal answers EIO: stopping the ranks must still go on.
    with contextlib.suppress(OSError):
        print(f"p2pdist launch: {message}", file=sys.stderr, flush=True)


class _Launcher:
    """Owns the child processes of one launch and tears them down."""

    def __init__(self, cfg: LaunchConfig) -> None:
        self.cfg = cfg
        self.procs: list[asyncio.subprocess.Process] = []
        self.exits: list[asyncio.Future[tuple[int, int]]] = []
        """Per rank: (the order the exit was seen in, its status), once it exited."""
        self._order = itertools.count()
        self.pumps: list[asyncio.Task[None]] = []
        self.stop = asyncio.Event()
        self.stop_signal = 0
        self.groups: set[int] = set()
        """Process groups of ranks not yet seen empty: the ones teardown may signal."""
        self.output = OutputWriter(functools.partial(self.on_signal, signal.SIGPIPE))
        self.guard = Guard(cfg.grace_s, self.say)

    def say(self, message: str) -> None:
        """One line of the launcher's own on stderr, after the ranks' lines already
        queued (never waiting: stderr may be blocked)."""
        self.output.post(sys.stderr.buffer, f"p2pdist launch: {message}\n".encode())

    async def start(self, envs: Sequence[dict[str, str]]) -> None:
        """Spawn one child per environment, each with its output pumps."""
        loop = asyncio.get_running_loop()
        for rank, env in enumerate(envs):
            exited: asyncio.Future[tuple[int, int]] = loop.create_future()
            try:
                # create_subprocess_exec, with a protocol that tells the process's exit.
                transport, protocol = await loop.subprocess_exec(
                    functools.partial(_RankProtocol, exited, self._order),
                    *self.cfg.command,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE,
                    env=env,
                    start_new_session=True,
                )
            except OSError as exc:
                if exc.errno in _TOO_MANY_FILES:
                    raise _too_many_files(f"start rank {rank}", "two per rank") from exc
                raise CommandNotStarted(self.cfg.command[0], exc) from exc
            proc = asyncio.subprocess.Process(transport, protocol, loop)
            self.procs.append(proc)
            self.exits.append(exited)
            self.groups.add(proc.pid)  # start_new_session: its pid is its group's id
            self.guard.watch(proc.pid)
            prefix = f"[rank {rank}] ".encode()
            assert proc.stdout is not None and proc.stderr is not None
            for stream, out in ((proc.stdout, sys.stdout.buffer), (proc.stderr, sys.stderr.buffer)):
                pump = _pump(stream, self.output, out, prefix)
                self.pumps.append(asyncio.create_task(pump))

    def on_signal(self, signum: int) -> None:
        """Signal handler: ask :meth:`supervise` to stop everything. SIGQUIT is passed on
        to the ranks first, so that they dump what a user sends it for (core files,
        faulthandler tracebacks of hung ranks) before the usual teardown."""
        if signum == signal.SIGQUIT:
            self._signal_running(signal.SIGQUIT)
        if not self.stop_signal:
            self.stop_signal = signum
        self.stop.set()

    async def supervise(self) -> int:
        """Wait until all ranks exit 0, one fails, or a stop signal; return the status."""
        waits: dict[asyncio.Future[tuple[int, int]], int] = {
            exited: rank for rank, exited in enumerate(self.exits)
        }
        stopper = asyncio.create_task(self.stop.wait())
        try:
            while waits:
                watched: set[asyncio.Future[Any]] = {*waits, stopper}
                done, _ = await asyncio.wait(
                    watched, timeout=_GROUP_POLL_S, return_when="FIRST_COMPLETED"
                )
                self._prune_groups()  # forget emptied groups before their ids are reused
                if stopper in done:
                    self.say(f"got {_signal_name(self.stop_signal)}; stopping all ranks")
                    return 128 + self.stop_signal
                # In the order the exits were seen: a rank that failed because another
                # crashed just before (in the same pass) must not be blamed for it.
                ended = [exited for exited in waits if exited in done]
                for exited in sorted(ended, key=lambda f: f.result()[0]):
                    result = RankExit(waits.pop(exited), exited.result()[1])
                    if not result.ok:
                        self.say(f"{result.describe()}; stopping the other ranks")
                        return exit_status(result.returncode)
            return 0
        finally:
            stopper.cancel()

    def _signal_running(self, sig: int) -> None:
        for proc in self.procs:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, sig)

    def _prune_groups(self) -> None:
        if not self.groups:
            return
        alive = live_groups(self.groups)
        for pgid in self.groups - alive:
            self.guard.forget(pgid)
        self.groups = alive

    def _signal_groups(self, sig: int) -> None:
        """Signal the process group of every rank, also of ranks that have exited: their
        background children are still in it. Only groups not yet seen empty: a group's
        id is not reused while a process is in it, but it may be once it is empty (the
        launcher looks every :data:`_GROUP_POLL_S` seconds; teardown signals right after
        a look, in :meth:`_groups_alive` or :meth:`_wait_all`)."""
        for pgid in self.groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, sig)

    def _groups_alive(self) -> bool:
        self._prune_groups()
        return bool(self.groups)

    async def _wait_all(self, timeout: float) -> bool:
        """Wait until every rank and everything left in its process group has exited."""
        running = [exited for exited in self.exits if not exited.done()]
        deadline = asyncio.get_running_loop().time() + timeout
        if running:  # (asyncio.wait cancels nothing: a later wait waits for them still)
            _, pending = await asyncio.wait(running, timeout=timeout)
            if pending:
                return False
        while self._groups_alive():  # the ranks' own children: nothing to wait on
            if asyncio.get_running_loop().time() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    async def teardown(self) -> None:
        """Stop every rank still running (TERM, grace, KILL) and drain their output."""
        if self.stop_signal == signal.SIGQUIT:  # let them finish their dumps first
            await self._wait_all(self.cfg.grace_s)
        if self._groups_alive():
            self._signal_groups(signal.SIGTERM)
            if not await self._wait_all(self.cfg.grace_s):
                self.say(f"ranks still running after {self.cfg.grace_s:g} s; sending SIGKILL")
                self._signal_groups(signal.SIGKILL)
                if not await self._wait_all(self.cfg.kill_wait_s):
                    self.say("some ranks did not exit even after SIGKILL")
        if self.pumps:
            _, pending = await asyncio.wait(self.pumps, timeout=self.cfg.drain_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*self.pumps, return_exceptions=True)


async def _run(cfg: LaunchConfig, envs: Sequence[dict[str, str]]) -> int:
    launcher = _Launcher(cfg)
    loop = asyncio.get_running_loop()
    # SIGHUP too: the ranks run in sessions of their own, so a closed terminal or a
    # dropped ssh connection would otherwise kill the launcher alone and orphan them.
    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
    for sig in handled:
        loop.add_signal_handler(sig, launcher.on_signal, sig)
    try:
        await launcher.start(envs)
        return await launcher.supervise()
    finally:
        await asyncio.shield(launcher.teardown())
        launcher.guard.done()  # (not after a failed teardown: the guard finishes it)
        for sig in handled:
            loop.remove_signal_handler(sig)
        launcher.output.close(cfg.drain_s)  # what is still queued (a blocked output: dropped)


def launch(cfg: LaunchConfig) -> int:
    """Run ``cfg.nprocs`` ranks of ``cfg.command``; return the launcher's exit status."""
    # A closed stdout or stderr (`>&-`) is None here: the ranks' lines go nowhere.
    if sys.stdout is None:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the process's lifetime
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115
    _open_files_limit(at_least=2 * cfg.nprocs + 64)
    seed = cfg.seed if cfg.seed is not None else secrets.token_hex(32)
    ports = pick_free_ports(cfg.host, cfg.nprocs)
    peers = [_format_peer(cfg.host, port) for port in ports]
    for name in _NOT_PASSED_ON:
        if os.environ.get(name):
            _say(f"not passing {name} on: the ranks reach each other at {ENV_PEERS}")
    # The launcher's own values: an exported one that differs would go unseen.
    try:
        differs = env_flag(ENV_TLS, cfg.tls) != cfg.tls  # (unset or empty: cfg.tls)
    except UsageError:  # not a yes/no at all: replaced too
        differs = True
    if differs:
        mode = "TLS" if cfg.tls else "plaintext (--plaintext)"
        _say(f"not passing {ENV_TLS}={os.environ[ENV_TLS]} on: the ranks run {mode}")
    if cfg.seed is None and os.environ.get(ENV_SEED):
        _say(f"not passing {ENV_SEED} on: the ranks get a random seed (--seed to choose one)")
    envs = [
        rank_env(os.environ, rank=r, world=cfg.nprocs, seed=seed, peers=peers, tls=cfg.tls)
        for r in range(cfg.nprocs)
    ]
    return asyncio.run(_run(cfg, envs))
