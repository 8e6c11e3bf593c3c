"""Choosing the event loop: asyncio's own (the default), or uvloop.

p2pdist works on any asyncio event loop and never installs a loop policy: a library
user picks the loop by how they start their program::

    import uvloop                 # pip install "p2pdist[fast]"
    uvloop.run(main())            # or asyncio.run(main()) for asyncio's own loop

The programs p2pdist ships (``p2pdist demo``, ``bench``, ``doctor``, ``p2pdist-relay``)
start their loop through :func:`run`, which takes asyncio's loop unless told otherwise
(the benchmarks use it too, and measure both loops side by side when uvloop is there):
``--loop uvloop`` on those commands, or ``P2PDIST_LOOP=uvloop`` in the environment
(inherited by the processes they start), takes uvloop and fails clearly without it;
``auto`` takes uvloop when it is installed. asyncio stays the default because it
measured faster for TCP bulk transfers here (docs/performance.md, "Event loop").
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from collections.abc import Callable, Coroutine
from typing import Any, Final, TypeVar

from .errors import UsageError

__all__ = [
    "LOOP_CHOICES",
    "LOOP_ENV",
    "loop_factory",
    "loop_name",
    "resolve_loop",
    "run",
    "uvloop_available",
]

LOOP_ENV: Final = "P2PDIST_LOOP"
"""Environment variable naming the loop for p2pdist's own programs (``asyncio`` when unset)."""
LOOP_CHOICES: Final = ("auto", "asyncio", "uvloop")

T = TypeVar("T")


def uvloop_available() -> bool:
    """Whether uvloop can be imported here."""
    return importlib.util.find_spec("uvloop") is not None


def resolve_loop(choice: str | None = None) -> str:
    """``"asyncio"`` or ``"uvloop"`` for ``choice`` (None: ``$P2PDIST_LOOP``, else
    ``asyncio``; ``auto`` is uvloop when installed). UsageError for an unknown name or for
    ``uvloop`` without uvloop installed."""
    from_env = choice is None and bool(os.environ.get(LOOP_ENV))
    name = (choice if choice is not None else os.environ.get(LOOP_ENV) or "asyncio").strip()
    name = name.lower()
    if name not in LOOP_CHOICES:
        where = f"{LOOP_ENV} in the environment: " if from_env else ""
        raise UsageError(
            f"{where}event loop must be one of {', '.join(LOOP_CHOICES)}, got {name!r}"
        )
    if name == "auto":
        return "uvloop" if uvloop_available() else "asyncio"
    if name == "uvloop" and not uvloop_available():
        raise UsageError('uvloop is not installed (pip install "p2pdist[fast]")')
    return name


def loop_factory(choice: str | None = None) -> Callable[[], asyncio.AbstractEventLoop]:
    """A function making a new loop of the kind :func:`resolve_loop` picks."""
    if resolve_loop(choice) == "uvloop":
        import uvloop

        factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
        return factory
    return asyncio.new_event_loop


def run(main: Coroutine[Any, Any, T], *, loop: str | None = None) -> T:
    """Run ``main`` to completion on a new loop (see :func:`resolve_loop` for ``loop``),
    like :func:`asyncio.run`; no global loop policy is touched."""
    try:
        factory = loop_factory(loop)
    except BaseException:
        main.close()  # never awaited: do not leave a "coroutine was never awaited" warning
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)


def loop_name(loop: asyncio.AbstractEventLoop | None = None) -> str:
    """``"uvloop"`` or ``"asyncio"`` for ``loop`` (default: the running loop)."""
    loop = loop if loop is not None else asyncio.get_running_loop()
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"
