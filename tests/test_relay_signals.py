"""relay/stopsignals.py in process: the handlers p2pdist-relay installs for SIGTERM,
SIGINT and SIGHUP (the relay process itself: tests/test_relay_server.py)."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Iterator

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
    import relay.__main__ as relay_main
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
