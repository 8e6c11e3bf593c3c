"""The relay program (``p2pdist-relay``, ``python -m relay``): run a relay until SIGTERM
or SIGINT. Its entry point is :mod:`relay.entry`, which takes the signals first.

Prints exactly one line ``relay url: URL`` to stdout once listening (tools parse it);
logs go to stderr as ``time level logger event key=value ...``. SIGHUP reloads the
allowlist and the certificate. Exit status: 0 after a graceful shutdown, 2 for a
configuration error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from p2pdist import eventloop
from p2pdist.errors import UsageError

from .cli import load_config
from .config import ConfigError, RelayConfig
from .entry import EarlySignals
from .logfmt import kv
from .server import RelayServer
from .stopsignals import LoopSignals, ProcessSignals

__all__ = ["main", "run"]

log = logging.getLogger("relay")


def _raise_fd_limit() -> None:
    """Each client is one file descriptor: lift the soft limit to the hard one, and log
    both (the server sizes its socket budget from the soft limit and warns when that
    cannot hold max-clients)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as exc:  # pragma: no cover - container policy
            log.warning(kv("rlimit_nofile_raise_failed", error=exc))
    unlimited = resource.RLIM_INFINITY
    log.info(
        kv(
            "rlimit_nofile",
            soft="unlimited" if soft == unlimited else soft,
            hard="unlimited" if hard == unlimited else hard,
        )
    )


def _url_file_temp(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def _check_writable(path: Path) -> None:
    """ConfigError, before the relay binds, when the url-file's directory takes no new
    file (it was found only after the relay had started to listen: an operator's trial)."""
    tmp = _url_file_temp(path)
    try:
        tmp.touch()
        tmp.unlink()
    except OSError as exc:
        raise ConfigError(f"cannot write url-file {path}: {exc.strerror or exc}") from None


def _write_atomically(path: Path, text: str) -> None:
    tmp = _url_file_temp(path)
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise ConfigError(f"cannot write url-file {path}: {exc.strerror or exc}") from None


async def run(
    config: RelayConfig, *, exiting: bool = False, early: EarlySignals | None = None
) -> int:
    """Serve until SIGTERM/SIGINT, then shut down gracefully; returns the exit status.

    SIGHUP reloads the allowlist and the certificate (one that comes while the relay
    starts does so once it listens). During the drain (bounded by
    ``drain_timeout``) a reload is skipped and another stop signal changes nothing: the
    default action must not kill the process mid-drain. ``exiting``: the process ends
    when this returns (``p2pdist-relay``), so these signals stay without effect from
    the end of the drain until the process is gone (a teardown that hangs then needs
    SIGKILL, as systemd sends after TimeoutStopSec); run it on the main thread.
    Otherwise their default actions come back then. ``early``: the signals taken
    while the program loaded (:mod:`relay.entry`), acted on once these handlers are in."""
    loop = asyncio.get_running_loop()
    log.info(kv("event_loop", loop=eventloop.loop_name(loop)))
    server = RelayServer(config)
    stop = asyncio.Event()
    reload_when_started = False

    def on_signal(sig: signal.Signals) -> None:
        nonlocal reload_when_started
        if sig != signal.SIGHUP:
            stop.set()
        elif stop.is_set():
            log.info(kv("reload_skipped", why="stopping"))
        elif server.url:
            server.reload()
        else:  # start may have read the files before they changed: read them again after
            log.info(kv("reload_deferred", why="starting"))
            reload_when_started = True

    if config.url_file is not None:
        _check_writable(config.url_file)
    # In before the url line: whoever reads it may signal at once.
    signals = ProcessSignals(loop, on_signal) if exiting else LoopSignals(loop, on_signal)
    for sig in early.take() if early is not None else ():  # (its handlers are out now)
        on_signal(sig)
    if stop.is_set():  # told to stop while the program loaded: it never listens
        signals.close()
        log.info(kv("stopped", why="a stop signal came while the relay was loading"))
        return 0
    try:
        await server.start()
        if reload_when_started:
            on_signal(signal.SIGHUP)  # listening now: reloads, or says why it skips
        if config.url_file is not None:
            _write_atomically(config.url_file, server.url + "\n")
        print(f"relay url: {server.url}", flush=True)
        await stop.wait()
    finally:
        stop.set()  # a start that failed is stopping too: no reload meanwhile
        try:
            await server.close()
        finally:
            signals.close()
            if config.url_file is not None and server.url:
                _remove_if_ours(config.url_file, server.url + "\n")
    return 0


def _remove_if_ours(path: Path, text: str) -> None:
    """Remove the url-file we wrote, unless it now holds something else (another relay's
    URL): a stopped relay's URL (with an ephemeral key, a pin no relay holds any more)
    must not stay there for scripts to dial."""
    with contextlib.suppress(OSError, UnicodeDecodeError):
        if path.read_text() == text:
            path.unlink()


def main(argv: Sequence[str] | None = None, *, early: EarlySignals | None = None) -> int:
    """Run ``p2pdist-relay`` with ``argv`` (the command line's by default); ``early``:
    the signals taken while the program loaded, see :func:`run`."""
    warnings: list[str] = []
    try:
        config = load_config(argv, warnings=warnings)
    except ConfigError as exc:
        print(f"p2pdist-relay: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    for line in warnings:
        log.warning(line)
    _raise_fd_limit()
    try:
        return eventloop.run(run(config, exiting=True, early=early), loop=config.loop)
    except UsageError as exc:  # --loop uvloop without uvloop installed
        print(f"p2pdist-relay: error: {exc}", file=sys.stderr)
        return 2
    except ConfigError as exc:
        print(f"p2pdist-relay: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # pragma: no cover - a second Ctrl-C during shutdown
        return 130
