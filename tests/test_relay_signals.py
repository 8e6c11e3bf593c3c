"""relay/stopsignals.py in process: the handlers p2pdist-relay installs for SIGTERM,
SIGINT and SIGHUP (the relay process itself: tests/test_relay_server.py)."""

from __future__ import annotations

import asyncio
import contextlib
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from relay.stopsignals import SIGNALS, ProcessSignals


@pytest.fixture
def handlers_restored() -> Iterator[None]:
    """Give the test process its own handlers and wake-up fd back afterwards."""
    before = {sig: signal.getsignal(sig) for sig in SIGNALS}
    wakeup = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(wakeup)
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(wakeup)


def _raise_on_another_thread(sig: int) -> threading.Thread:
    """Send ``sig`` to a thread of our own once the main thread waits in the event loop,
    so its C handler runs on that thread (as when numpy's OpenBLAS threads take a
    process's signal). Nothing else wakes the loop: the thread is not awaited."""

    def later() -> None:
        time.sleep(0.2)
        signal.pthread_kill(threading.get_ident(), sig)

    thread = threading.Thread(target=later, daemon=True)
    thread.start()
    return thread


@pytest.mark.usefixtures("handlers_restored")
async def test_a_signal_taken_by_another_thread_wakes_the_loop_at_once() -> None:
    # Without a wake-up fd the loop slept on in its wait until something else woke it
    # (in the relay, its next tick: up to 1 s) before the handler ran.
    loop = asyncio.get_running_loop()
    got = asyncio.Event()
    seen: list[signal.Signals] = []

    def on_signal(sig: signal.Signals) -> None:
        seen.append(sig)
        got.set()

    # Nothing on the loop may wake it (no timer): a thread does after 10 s, and notes it.
    stop_guard, guard_woke = threading.Event(), threading.Event()

    def guard() -> None:
        if not stop_guard.wait(10):
            guard_woke.set()
            loop.call_soon_threadsafe(lambda: None)

    signals = ProcessSignals(loop, on_signal)
    try:
        threading.Thread(target=guard, daemon=True).start()
        sender = _raise_on_another_thread(signal.SIGHUP)
        await asyncio.wait_for(got.wait(), 30)  # a timer after the guard: a bound only
        assert not guard_woke.is_set(), "the loop slept on until something else woke it"
        assert seen == [signal.SIGHUP]
        sender.join(10)
    finally:
        stop_guard.set()
        signals.close()
    for sig in SIGNALS:  # ignored from now on, and nothing left behind
        assert signal.getsignal(sig) is signal.SIG_IGN
    assert signal.set_wakeup_fd(-1) == -1


@pytest.mark.usefixtures("handlers_restored")
async def test_after_close_a_signal_is_dropped() -> None:
    loop = asyncio.get_running_loop()
    seen: list[signal.Signals] = []
    signals = ProcessSignals(loop, seen.append)
    signals.close()
    signal.raise_signal(signal.SIGHUP)  # ignored: neither delivered nor the default action
    await asyncio.sleep(0.05)
    assert seen == []


@pytest.mark.usefixtures("handlers_restored")
async def test_a_sighup_while_the_relay_starts_reloads_once_it_listens(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A SIGHUP before the relay listened was dropped without a word, though start may
    have read the allowlist and the certificate before the operator changed them."""
    import relay.app as relay_main
    from relay.config import RelayConfig
    from relay.server import RelayServer

    start, reloads = RelayServer.start, []

    async def slow_start(self: RelayServer) -> None:
        signal.raise_signal(signal.SIGHUP)
        await asyncio.sleep(0.05)  # the loop's handler runs while start is under way
        assert reloads == []
        await start(self)
        signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(RelayServer, "start", slow_start)
    monkeypatch.setattr(RelayServer, "reload", lambda self: reloads.append(self.url))
    caplog.set_level("INFO", logger="relay")
    config = RelayConfig(host="127.0.0.1", port=0, stun_port=0)
    assert await asyncio.wait_for(relay_main.run(config), 30) == 0
    assert len(reloads) == 1 and reloads[0]  # once, and once the relay had its url
    assert "reload_deferred why=starting" in caplog.text


def _catches(pid: int, sig: signal.Signals) -> bool:
    """Whether process ``pid`` has a handler of its own for ``sig`` (Linux's SigCgt)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


def test_the_entry_point_takes_the_signals_before_the_slow_imports() -> None:
    """The relay's signal handlers came in only once numpy, cryptography and the
    configuration had loaded (a few hundred ms), and a SIGHUP meanwhile killed it with
    exit 129 (an operator's trial). The entry point now loads nothing slow first."""
    probe = (
        "import sys, relay.entry; "
        "print(sorted(m for m in ('numpy', 'cryptography', 'asyncio', 'p2pdist') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out


@contextlib.contextmanager
def _relay_loading(command: list[str]) -> Iterator[subprocess.Popen[str]]:
    """A relay process (``python COMMAND``), once it catches SIGHUP: still loading,
    with the entry point's handlers in. Killed on the way out if still running."""
    argv = [*command, "--host", "127.0.0.1", "--port", "0", "--stun-port", "0"]
    proc = subprocess.Popen(
        [sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 30
        while not _catches(proc.pid, signal.SIGHUP):
            assert proc.poll() is None and time.monotonic() < deadline, proc.poll()
            time.sleep(0.001)
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/status")
@pytest.mark.parametrize("command", [["-m", "relay"], ["-c", "import relay.entry as e; e.main()"]])
def test_a_sighup_while_the_relay_loads_reloads_once_it_listens(command: list[str]) -> None:
    """SIGHUP while it still loads, then SIGTERM: it lives on, reloads once it listens,
    and stops cleanly."""
    with _relay_loading(command) as proc:
        proc.send_signal(signal.SIGHUP)
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 30)  # bounded: a hang fails
        line = proc.stdout.readline() if ready else ""  # "" also if it died
        assert line.startswith("relay url: "), (line, proc.poll())
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "reload_deferred why=starting" in err and " reload\n" in err, err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/status")
def test_a_sigterm_while_the_relay_loads_stops_it_before_it_listens() -> None:
    """A stop signal while it loads: it exits 0 without ever listening or printing a URL
    (a tool reading the url line would dial a relay on its way out: a reviewer)."""
    with _relay_loading(["-m", "relay"]) as proc:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert out == "" and "listening" not in err, (out, err)
    assert "stopped why=" in err, err


def test_the_entry_points_handlers_give_way_when_the_relay_ends_without_its_own() -> None:
    """A relay that ended before it put its own handlers in (a bad configuration) leaves
    the process's handlers as they were, not swallowing every later Ctrl-C."""
    from relay.entry import EarlySignals

    before = {sig: signal.getsignal(sig) for sig in SIGNALS}
    early = EarlySignals()
    try:
        assert all(signal.getsignal(sig) != before[sig] for sig in SIGNALS)
    finally:
        early.release()
    assert {sig: signal.getsignal(sig) for sig in SIGNALS} == before


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc")
async def test_a_url_file_that_cannot_be_written_is_refused_before_binding(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Only its directory's existence was checked: a relay whose url-file could not be
    written (a directory it may not write in) listened, then exited 2 (an operator's
    trial). /proc takes no new file, even from root."""
    import relay.app as relay_main
    from relay.config import ConfigError, RelayConfig
    from relay.server import RelayServer

    started: list[RelayServer] = []
    monkeypatch.setattr(RelayServer, "start", started.append)
    config = RelayConfig(host="127.0.0.1", port=0, stun_port=0, url_file=Path("/proc/relay.url"))
    with pytest.raises(ConfigError, match=r"cannot write url-file /proc/relay\.url"):
        await relay_main.run(config)
    assert started == []
