"""Run the whole federated-learning demo on this machine with one command.

    python -m examples.federated.run                 # coordinator on TCP 127.0.0.1
    python -m examples.federated.run --relay local   # start a local relay; everyone dials it
    python -m examples.federated.run --relay URL     # use a running relay

The coordinator runs in this process; each client is its own process
(``python -m examples.federated.client``), with a non-IID shard of the digits data.
By default, of 8 clients: one is malicious (its updates are scaled by 1e6), one is slow
(its updates arrive a round late), one crashes mid-round (it is restarted and rejoins,
receiving the current model and round id), and one joins late. The table shows, per
round: members, participants, stale updates, drops, rejections, the closing reason,
test loss and accuracy. The accuracy plot goes to ``--png``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from p2pdist import SecretKey
from p2pdist.federated import Coordinator

from .coordinator import add_coordinator_args, check_coordinator_args, serve
from .model import MIN_SHARD, load_digits

ROOT = Path(__file__).resolve().parents[2]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(
        prog="python -m examples.federated.run",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_coordinator_args(p)
    p.add_argument("--relay", default=None, help="'local' (start one) or a relay URL")
    p.add_argument("--malicious", type=int, default=1, help="clients scaling updates by 1e6")
    p.add_argument(
        "--attack",
        choices=["scale", "nan"],
        default="scale",
        help="what the malicious clients send: updates x1e6, or NaNs",
    )
    p.add_argument("--slow", type=int, default=1, help="slow clients")
    p.add_argument("--slow-factor", type=float, default=8.0, help="their compute x this")
    p.add_argument("--dropouts", type=int, default=1, help="clients that crash mid-round")
    p.add_argument("--late", type=int, default=1, help="clients that join a few rounds late")
    p.add_argument("--work", type=float, default=0.05, help="simulated compute s/round")
    p.add_argument("--alpha", type=float, default=0.5, help="Dirichlet non-IID concentration")
    p.add_argument(
        "--logs", type=Path, default=None, help="client logs (None: a temporary directory)"
    )
    args = p.parse_args(argv)
    check_coordinator_args(p, args)
    roles = args.malicious + args.slow + args.dropouts + args.late
    if roles > args.clients:
        p.error(f"{roles} special clients but only --clients {args.clients}")
    if args.late >= args.clients:
        p.error("--late must leave at least one client that starts at once")
    if not args.alpha > 0:
        p.error(f"--alpha must be positive, got {args.alpha}")
    most = len(load_digits()[0].y) // MIN_SHARD
    if args.clients > most:
        p.error(f"--clients {args.clients}: the data has {MIN_SHARD} samples for at most {most}")
    return args


class Fleet:
    """The client processes (and the local relay, if any)."""

    def __init__(self, args: argparse.Namespace, coordinator: str, logs: Path) -> None:
        self.args = args
        self.coordinator = coordinator
        self.logs = logs
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.address: str | None = None
        self.relay: str | None = None
        self.key_seed = secrets.token_hex(16)

    def role(self, i: int) -> str:
        """What client ``i`` does: malicious, slow, dropout, late or honest."""
        a = self.args
        bounds = [
            ("malicious", a.malicious),
            ("slow", a.slow),
            ("dropout", a.dropouts),
            ("late", a.late),
        ]
        start = 0
        for name, count in bounds:
            if start <= i < start + count:
                return name
            start += count
        return "honest"

    def start(self, i: int, *, crash: bool = True) -> None:
        """Start client ``i`` with the flags of its role."""
        a = self.args
        cmd = [
            sys.executable,
            "-m",
            "examples.federated.client",
            "--coordinator",
            self.coordinator,
            "--index",
            str(i),
            "--clients",
            str(a.clients),
            "--seed",
            str(a.seed),
            "--alpha",
            str(a.alpha),
            "--epochs",
            str(a.epochs),
            "--work",
            str(a.work),
            "--key-seed",  # a restarted client keeps its identity: its old connection is
            self.key_seed,  # replaced at once, over TCP and through a relay alike
        ]
        cmd += ["--relay", self.relay] if self.relay else ["--address", str(self.address)]
        if a.plaintext:
            cmd.append("--plaintext")
        role = self.role(i)
        if role == "malicious":
            cmd += ["--attack", a.attack]
        elif role == "slow":
            cmd += ["--slow", str(a.slow_factor)]
        elif role == "dropout" and crash:
            cmd += ["--crash-round", str(max(1, a.rounds // 3))]
        log = (self.logs / f"client{i}.log").open("ab")
        self.procs[i] = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        log.close()

    async def supervise(self, coord: Coordinator) -> None:
        """Start late joiners a few rounds in, restart crashed clients once; raise
        :class:`ClientFailed` when a client exits with an error."""
        late = [i for i in range(self.args.clients) if self.role(i) == "late"]
        late_round = max(1, self.args.rounds // 5)
        restarted: set[int] = set()
        while True:
            await asyncio.sleep(0.05)
            if late and coord.round >= late_round:
                for i in late:
                    print(f"   + client {i} joins late, at round {coord.round}", flush=True)
                    self.start(i)
                late = []
            for i, proc in list(self.procs.items()):
                code = proc.poll()
                if code == CRASHED and self.role(i) == "dropout" and i not in restarted:
                    restarted.add(i)
                    print(
                        f"   ! client {i} crashed mid-round {coord.round}; restarting it",
                        flush=True,
                    )
                    self.start(i, crash=False)
                elif code not in (None, 0, CRASHED) and coord.round < self.args.rounds:
                    # (after the last round a client's error cannot change the result)
                    log = self.logs / f"client{i}.log"
                    tail = log.read_text(errors="replace").strip().splitlines()[-5:]
                    raise ClientFailed(
                        f"client {i} exited with status {code}; the end of {log}:\n"
                        + "\n".join(f"    {line}" for line in tail)
                    )

    def stop(self) -> None:
        """Stop every process (clients get stop from the coordinator first): all of them
        get up to 5 s together to leave, then SIGTERM and 2 s more, then SIGKILL."""
        for signum, grace in ((None, 5.0), (signal.SIGTERM, 2.0), (signal.SIGKILL, 10.0)):
            running = [p for p in self.procs.values() if p.poll() is None]
            if not running:
                return
            for proc in running if signum is not None else ():
                proc.send_signal(signum)
            deadline = time.monotonic() + grace
            for proc in running:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))


CRASHED = 17
"""The exit status of a client that crashes on purpose (``--crash-round``)."""


class ClientFailed(RuntimeError):
    """A client process exited with an error: the run cannot go on as planned."""


def start_local_relay(logs: Path) -> tuple[subprocess.Popen[bytes], str]:
    """``python -m relay`` on 127.0.0.1 (any free port); returns it and its URL."""
    err = (logs / "relay.log").open("ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "relay", "--host", "127.0.0.1", "--port", "0"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=err,
    )
    err.close()
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 30.0)
    line = proc.stdout.readline().decode() if ready else ""
    if not line.startswith("relay url: "):
        proc.kill()
        raise SystemExit(f"the local relay did not start; see {logs / 'relay.log'}")
    return proc, line[len("relay url: ") :].strip()


async def main_async(args: argparse.Namespace, logs: Path) -> None:
    """Coordinator here, clients as processes; returns when all rounds are done.

    SIGTERM (kill, a CI job's timeout) ends the run like Ctrl-C: the coordinator tells
    the clients to stop, then clients and the local relay are stopped; a second signal
    during that cleanup is ignored."""
    loop = asyncio.get_running_loop()
    me = asyncio.current_task()
    assert me is not None
    terminated: list[bool] = []
    cleaning: list[bool] = []

    def on_sigterm() -> None:
        if not terminated and not cleaning and not me.cancelling():
            terminated.append(True)
            me.cancel()

    loop.add_signal_handler(signal.SIGTERM, on_sigterm)  # before anything is started
    key = SecretKey.generate()
    fleet = Fleet(args, str(key.endpoint_id), logs)
    relay_proc: subprocess.Popen[bytes] | None = None
    supervisor: asyncio.Task[None] | None = None
    running: asyncio.Task[dict[str, object]] | None = None

    def on_ready(coord: Coordinator) -> None:
        nonlocal supervisor
        if coord.address is not None:
            fleet.address = f"{coord.address[0]}:{coord.address[1]}"
        for i in range(args.clients):
            if fleet.role(i) != "late":
                fleet.start(i)
        print(
            f"started {args.clients - args.late} client processes "
            f"({args.malicious} malicious, {args.slow} slow, {args.dropouts} crashing); "
            f"logs in {logs}",
            flush=True,
        )
        supervisor = loop.create_task(fleet.supervise(coord))

    try:
        if args.relay == "local":
            relay_proc, fleet.relay = start_local_relay(logs)
            print(f"local relay: {fleet.relay}")
        elif args.relay:
            fleet.relay = args.relay
        running = loop.create_task(
            serve(
                args,
                wait_for=args.clients - args.late,
                listen=None if fleet.relay else "127.0.0.1:0",
                relay=fleet.relay,
                key=key,
                on_ready=on_ready,
            )
        )
        while not running.done():
            await asyncio.wait({running}, timeout=0.1)
            if supervisor is not None and supervisor.done() and not supervisor.cancelled():
                supervisor.result()  # raises ClientFailed
        running.result()
    except asyncio.CancelledError:
        if terminated:
            raise SystemExit(128 + signal.SIGTERM) from None
        raise
    finally:
        cleaning.append(True)
        if running is not None and not running.done():
            running.cancel()  # the coordinator closes: it tells the clients to stop
            await asyncio.wait({running}, timeout=10)
        if running is not None and running.done() and not running.cancelled():
            running.exception()  # retrieved: the error that matters is already raised
        if supervisor is not None:
            supervisor.cancel()
        fleet.stop()
        if relay_proc is not None:
            relay_proc.terminate()
            try:
                relay_proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                relay_proc.kill()
                relay_proc.wait()
        loop.remove_signal_handler(signal.SIGTERM)


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    if not args.verbose:  # the table counts rejections; the log lines would clutter it
        logging.getLogger("p2pdist.federated").setLevel(logging.ERROR)
    logs = args.logs if args.logs is not None else Path(tempfile.mkdtemp(prefix="fedlogs-"))
    logs.mkdir(parents=True, exist_ok=True)
    try:
        asyncio.run(main_async(args, logs))
    except ClientFailed as exc:
        print(f"run stopped: {exc}", file=sys.stderr)
        print(f"client logs kept in {logs}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, asyncio.CancelledError):
        print(f"run stopped; client logs kept in {logs}", file=sys.stderr)
        return 130
    except BaseException:
        print(f"client logs kept in {logs}", file=sys.stderr)
        raise
    if args.logs is None:  # a temporary folder: only a failed run's logs are worth keeping
        shutil.rmtree(logs, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
