"""The federated-learning example: real digits data split non-IID across clients.

* The one-command demo (coordinator + client processes, with a malicious, a slow, a
  crashing and a late client) ends within 3 accuracy points of centralised training on
  the same data, and saves its plot.
* With a client sending updates scaled by 1e6 and no norm bound, the weighted mean is
  ruined, while the coordinate-wise median and the trimmed mean keep their accuracy.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from subprocess import Popen

import numpy as np
import pytest

pytest.importorskip("sklearn")

from transport_conformance import wait_until

from examples.federated import IDLE_TIMEOUT
from examples.federated.model import (
    Split,
    evaluate,
    init_model,
    load_digits,
    non_iid_shards,
    sgd,
)
from p2pdist import P2PTimeoutError, PunchConfig, SecretKey, TransportConfig
from p2pdist.federated import Coordinator, FederatedClient, FederatedConfig

ROOT = Path(__file__).resolve().parent.parent


def test_example_run_is_within_3_points_of_centralised_training(tmp_path: Path) -> None:
    summary, png = tmp_path / "summary.json", tmp_path / "accuracy.png"
    cmd = [
        sys.executable,
        "-m",
        "examples.federated.run",
        "--json",
        str(summary),
        "--png",
        str(png),
        "--logs",
        str(tmp_path / "logs"),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    print(proc.stdout[-4000:], proc.stderr[-4000:])
    assert proc.returncode == 0
    data = json.loads(summary.read_text())
    fed, central = data["federated_accuracy"], data["centralised_accuracy"]
    print(f"federated {fed:.2%}  centralised {central:.2%}  gap {100 * (central - fed):.2f} points")
    assert central - fed <= 0.03
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "round members particip stale dropped rejected" in proc.stdout
    assert "[####################]  30/30" in proc.stdout
    rows = data["rounds"]
    assert len(rows) == 30 and all(r["rejected"] >= 1 for r in rows)  # the 1e6 client
    assert sum(r["stale"] for r in rows) >= 5  # the slow client's updates, rolled over
    assert "crashed mid-round" in proc.stdout and "joins late" in proc.stdout


async def _federated_accuracy(rule: str, *, attacker: bool, rounds: int = 15) -> float:
    """Coordinator and 6 in-process clients (one maybe scaling its updates by 1e6)."""
    train, test = load_digits()
    shards = non_iid_shards(train.y, 6, alpha=1.0)
    plain = TransportConfig(tls=False)
    cfg = FederatedConfig(round_timeout=30.0, rule=rule, trim_fraction=0.2)
    async with Coordinator(init_model(), cfg, transport=plain) as coord:
        await coord.start(listen="127.0.0.1:0")
        assert coord.address is not None
        where = f"{coord.address[0]}:{coord.address[1]}"

        async def client(i: int) -> None:
            data = Split(train.x[shards[i]], train.y[shards[i]])
            cl = FederatedClient(coord.endpoint_id, address=where, transport=plain)
            task = await cl.connect()
            while task is not None:
                update = sgd(task.model, data, epochs=1, seed=task.round) - task.model
                if attacker and i == 0:
                    update = update * np.float32(1e6)
                await cl.submit(update, len(data.y), task.round)
                task = await cl.next_round(timeout=30)
            await cl.close()

        tasks = [asyncio.create_task(client(i)) for i in range(6)]
        await coord.wait_for_members(6, timeout=30)
        for _ in range(rounds):
            out = await coord.run_round()
            assert out.reason == "complete"
        acc = evaluate(coord.model, test)[1]
    await asyncio.gather(*tasks)
    return acc


async def test_median_and_trimmed_mean_keep_accuracy_against_a_1e6_client() -> None:
    clean = await _federated_accuracy("mean", attacker=False)
    ruined = await _federated_accuracy("mean", attacker=True)
    trimmed = await _federated_accuracy("trimmed_mean", attacker=True)
    median = await _federated_accuracy("median", attacker=True)
    print(f"mean clean {clean:.2%}, mean attacked {ruined:.2%}, ")
    print(f"trimmed mean attacked {trimmed:.2%}, median attacked {median:.2%}")
    assert clean > 0.85 and ruined < 0.5
    assert trimmed >= clean - 0.03 and median >= clean - 0.05


async def _example_client_against(
    coord: Coordinator, *extra: str
) -> tuple[asyncio.Task[int], FederatedClient]:
    """The example client's run() in this process, against ``coord``; returns its task
    and (once connected) its FederatedClient."""
    from examples.federated import client as example

    assert coord.address is not None
    made: list[FederatedClient] = []
    real = example.FederatedClient

    def spy(*args: object, **kwargs: object) -> FederatedClient:
        made.append(real(*args, **kwargs))  # type: ignore[arg-type]
        return made[-1]

    argv = ["--coordinator", str(coord.endpoint_id), "--plaintext"]
    argv += ["--address", f"{coord.address[0]}:{coord.address[1]}", *extra]
    args = example.parse_args(argv)
    example.FederatedClient = spy  # type: ignore[assignment,misc]
    try:
        task = asyncio.create_task(example.run(args))
        await coord.wait_for_members(1, timeout=30)
    finally:
        example.FederatedClient = real  # type: ignore[misc]
    return task, made[0]


async def test_example_client_stopped_while_training_exits_0(
    capsys: pytest.CaptureFixture[str],
) -> None:
    plain = TransportConfig(tls=False)
    async with Coordinator(init_model(), FederatedConfig(), transport=plain) as coord:
        await coord.start(listen="127.0.0.1:0")
        task, cl = await _example_client_against(
            coord, "--index", "0", "--clients", "2", "--work", "1.0"
        )
        # round 0's model arrived: the example trains from it (sleeps 1 s)
        await wait_until(lambda: cl.latest is not None, "round 0's model at the client")
        assert not cl.acks and not task.done()
    # the coordinator has stopped while the client trained
    assert await asyncio.wait_for(task, 30) == 0
    assert cl.stopped == "training is over"
    assert "client 0: done (training is over)" in capsys.readouterr().out


async def test_example_client_exits_1_with_the_reason_when_the_coordinator_fails(
    capsys: pytest.CaptureFixture[str],
) -> None:
    plain = TransportConfig(tls=False)
    with pytest.raises(P2PTimeoutError):
        async with Coordinator(init_model(), FederatedConfig(), transport=plain) as coord:
            await coord.start(listen="127.0.0.1:0")
            task, cl = await _example_client_against(
                coord, "--index", "0", "--clients", "2", "--work", "0"
            )
            await coord.wait_for_members(2, timeout=0.2)  # gives up: 1 of 2
    assert await asyncio.wait_for(task, 30) == 1
    assert cl.stop_error
    err = capsys.readouterr().err
    assert "client 0: the coordinator failed: P2PTimeoutError" in err
    assert "1 of 2 clients connected" in err


def test_example_client_keys_never_equal_the_coordinators_from_the_same_seed() -> None:
    from examples.federated.client import client_key, parse_args
    from p2pdist import SecretKey

    seed = "0123456789abcdef0123456789abcdef"
    coordinator_id = SecretKey.from_seed(seed, 0).endpoint_id  # as examples' coordinator
    ids = {client_key(seed, i).endpoint_id for i in range(4)}
    assert coordinator_id not in ids and len(ids) == 4
    assert client_key(seed, 1).endpoint_id == client_key(seed, 1).endpoint_id  # stable
    where = ["--coordinator", str(coordinator_id), "--address", "h:1"]
    args = parse_args([*where, "--index", "0", "--clients", "2", "--key-seed", seed])
    assert args.key_seed == seed


async def test_example_client_with_the_coordinators_seed_and_index_0_joins() -> None:
    from p2pdist import SecretKey

    seed = "0123456789abcdef0123456789abcdef"
    plain = TransportConfig(tls=False)
    key = SecretKey.from_seed(seed, 0)  # as examples.federated.coordinator --key-seed
    async with Coordinator(init_model(), FederatedConfig(), key=key, transport=plain) as coord:
        await coord.start(listen="127.0.0.1:0")
        task, cl = await _example_client_against(
            coord, "--index", "0", "--clients", "2", "--work", "0", "--key-seed", seed
        )
        assert coord.members == [str(cl.endpoint_id)] != [str(coord.endpoint_id)]
    assert await asyncio.wait_for(task, 30) == 0


@pytest.mark.parametrize(("index", "clients"), [(4, 2), (2, 2), (-1, 2), (0, 0)])
def test_example_client_refuses_an_index_outside_its_clients(
    index: int, clients: int, capsys: pytest.CaptureFixture[str]
) -> None:
    from examples.federated.client import parse_args

    argv = ["--coordinator", "x", "--address", "h:1", "--index", str(index)]
    with pytest.raises(SystemExit) as exc:
        parse_args([*argv, "--clients", str(clients)])
    assert exc.value.code == 2
    assert "must be" in capsys.readouterr().err


def test_example_coordinator_quorum_flag_is_a_fraction_up_to_1_and_a_count_above(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import argparse

    from examples.federated.coordinator import add_coordinator_args, fed_config

    p = argparse.ArgumentParser()
    add_coordinator_args(p)
    assert p.parse_args([]).quorum == 0.5
    one = fed_config(p.parse_args(["--quorum", "1"])).quorum
    assert one == 1.0 and isinstance(one, float)  # every member, not one update
    two = fed_config(p.parse_args(["--quorum", "2"])).quorum
    assert two == 2 and isinstance(two, int)
    for bad in ("2.5", "0", "-1", "x"):
        with pytest.raises(SystemExit):
            p.parse_args(["--quorum", bad])
    assert "whole count above 1" in capsys.readouterr().err
    helptext = p.format_help()
    assert "FRACTION" in helptext and "COUNT" in helptext


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rounds", "0"], "--rounds must be at least 1"),
        (["--relay", "notaurl"], "relay URL must start with https://"),
        (["--png", "/nonexistent-p2pdist-dir/x.png"], "no directory"),
        (["--round-timeout", "-1"], "round_timeout"),
        # every client late: nothing would ever start the rounds (a 120 s wait, then fail)
        (["--clients", "2", "--late", "2", *["--malicious", "0", "--slow", "0"]], "--late"),
        (["--alpha", "0"], "--alpha must be positive"),  # shards that are never drawn
        (["--clients", "500", "--late", "0"], "samples for at most"),
    ],
)
def test_example_run_refuses_bad_options_before_starting(args: list[str], message: str) -> None:
    """One line and exit 2 before any client starts (these used to be a traceback, some
    only after the whole run)."""
    cmd = [sys.executable, "-m", "examples.federated.run", *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr


_ID = SecretKey.from_seed("federated-example-seed", 0).endpoint_id


@pytest.mark.parametrize(
    ("module", "args", "message"),
    [
        ("coordinator", ["--listen", "127.0.0.1:99999"], "--listen: address"),
        ("coordinator", ["--listen", "nonsense"], "--listen: address"),
        ("client", ["--coordinator", "badid", "--address", "127.0.0.1:9"], "--coordinator:"),
        ("client", ["--coordinator", str(_ID), "--address", "127.0.0.1:99999"], "--address:"),
        ("client", ["--coordinator", str(_ID), "--relay", "notaurl"], "--relay:"),
    ],
)
def test_example_processes_refuse_bad_addresses_in_one_line(
    module: str, args: list[str], message: str
) -> None:
    """These were tracebacks from inside the coordinator or the client."""
    extra = ["--clients", "2"] + (["--index", "0"] if module == "client" else ["--rounds", "1"])
    cmd = [sys.executable, "-m", f"examples.federated.{module}", *args, *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_example_idle_timeout_outlasts_the_fallback_to_the_relay() -> None:
    """At 5 s every process of a run through a relay warned that a dying direct path
    could end its connection before it fell back to the relay."""
    punch = PunchConfig()
    assert punch.path_timeout + punch.keepalive < IDLE_TIMEOUT


def test_example_shards_refuse_what_cannot_be_drawn_instead_of_looping() -> None:
    """alpha 0 (numpy draws all zeros) or more clients than 10-sample shards looped
    forever."""
    train, _ = load_digits()
    with pytest.raises(ValueError, match="alpha must be positive"):
        non_iid_shards(train.y, 8, alpha=0.0)
    with pytest.raises(ValueError, match="at most"):
        non_iid_shards(train.y, len(train.y) // 10 + 1, alpha=0.5)
    with pytest.raises(ValueError, match="in 1000 draws"):
        non_iid_shards(train.y, len(train.y) // 10, alpha=1e-3)


def test_example_run_stops_when_a_client_fails(tmp_path: Path) -> None:
    """A client that exits with an error (not the planned crash) stops the run at once,
    with the end of its log (it used to be noticed only by the coordinator's 120 s wait
    for members)."""
    from examples.federated.run import ClientFailed, Fleet, parse_args

    args = parse_args(["--clients", "2", "--late", "0", "--dropouts", "0"])
    fleet = Fleet(args, "coordinator-id", tmp_path)
    (tmp_path / "client1.log").write_text("starting\nValueError: something broke\n")
    fleet.procs[0] = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    fleet.procs[1] = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])

    class Idle:
        round = 0

    try:
        with pytest.raises(ClientFailed, match="client 1 exited with status 3") as exc:
            asyncio.run(asyncio.wait_for(fleet.supervise(Idle()), 30))  # type: ignore[arg-type]
        assert "something broke" in str(exc.value)
    finally:
        fleet.procs[0].kill()
        fleet.stop()


@contextlib.contextmanager
def _run_until(cmd: list[str], marker: bytes, tmp_path: Path) -> Iterator[Popen[bytes]]:
    """Start ``cmd`` in a session of its own and read its output up to a line starting
    with ``marker`` (60 s at most; the run's stderr goes to ``run.err``); on exit, kill
    whatever of the session is left."""
    with (tmp_path / "run.err").open("wb") as err:
        proc = Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, start_new_session=True)
    try:
        assert proc.stdout is not None
        fd, seen, deadline = proc.stdout.fileno(), b"", time.monotonic() + 60
        while not any(line.startswith(marker) for line in seen.split(b"\n")):
            left = deadline - time.monotonic()
            assert left > 0, f"no {marker!r} line within 60 s: {seen[-500:]!r}"
            if select.select([fd], [], [], left)[0]:
                chunk = os.read(fd, 65536)
                assert chunk, f"the run ended before {marker!r}: {seen[-500:]!r}"
                seen += chunk
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)


def _stopped_by_sigterm(proc: Popen[bytes], tmp_path: Path) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, (tmp_path / "run.err").read_text()


def test_example_run_stops_its_clients_and_relay_on_sigterm(tmp_path: Path) -> None:
    """kill (SIGTERM) ends the run like Ctrl-C: clients and the local relay stop with it
    (the relay used to live on, as SIGTERM skipped the cleanup)."""
    cmd = [sys.executable, "-m", "examples.federated.run", "--relay", "local"]
    cmd += ["--rounds", "500", "--logs", str(tmp_path), "--png", str(tmp_path / "a.png")]
    with _run_until(cmd, b"started ", tmp_path) as proc:
        _stopped_by_sigterm(proc, tmp_path)  # before the clients joined: they are stopped
        deadline = time.monotonic() + 15  # what it started is gone
        while True:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            assert time.monotonic() < deadline, "a client or the relay outlived the run"
            time.sleep(0.1)


def test_example_run_tells_joined_clients_to_stop_on_sigterm(tmp_path: Path) -> None:
    """Once the clients have joined, SIGTERM makes the coordinator tell them to stop:
    they leave on their own (their logs say why), nobody waits for the 5 s grace."""
    cmd = [sys.executable, "-m", "examples.federated.run", "--clients", "3", "--late", "0"]
    cmd += ["--dropouts", "0", "--rounds", "500", "--logs", str(tmp_path)]
    cmd += ["--png", str(tmp_path / "a.png")]
    with _run_until(cmd, b"3 clients; initial loss", tmp_path) as proc:
        _stopped_by_sigterm(proc, tmp_path)
        logs = [(tmp_path / f"client{i}.log").read_text() for i in range(3)]
        assert all("the coordinator was interrupted" in log for log in logs), logs


def _ctrl_c_as_at_a_terminal() -> None:
    """In the child before it runs: SIGINT's default action, as a program started from a
    terminal has. A test run started in the background by a shell without job control
    (`cmd &` in a script, nohup) ignores SIGINT, its children inherit that, and Python
    then leaves Ctrl-C ignored (asyncio.run only takes over the default handler): the
    coordinator waited on for good and the test failed after 30 s."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_example_coordinator_stopped_with_ctrl_c_exits_130_without_a_traceback() -> None:
    """Ctrl-C while it waits for clients: a short line and exit 130 (it printed a
    KeyboardInterrupt traceback)."""
    cmd = [sys.executable, "-m", "examples.federated.coordinator", "--listen", "127.0.0.1:0"]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_ctrl_c_as_at_a_terminal,
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready and proc.stdout.readline().startswith("coordinator id: ")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "coordinator stopped" in err


def test_example_coordinator_failures_are_one_line_and_exit_1() -> None:
    """No clients within --join-timeout, and a port that is taken: an error line and exit
    1 (both were tracebacks)."""
    base = [sys.executable, "-m", "examples.federated.coordinator", "--rounds", "1"]
    base += ["--clients", "2", "--png", ""]
    cmd = [*base, "--listen", "127.0.0.1:0", "--join-timeout", "0.5"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "coordinator: error: 0 of 2 clients connected within" in proc.stderr  # (once)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd = [*base, "--listen", f"127.0.0.1:{port}"]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "coordinator: error: " in proc.stderr
    assert "cannot listen" in proc.stderr


def test_example_client_that_cannot_reach_its_coordinator_is_one_line_and_exits_1() -> None:
    """A coordinator at that address with another id: the TLS pin refuses it at once."""
    cmd = [sys.executable, "-m", "examples.federated.coordinator", "--listen", "127.0.0.1:0"]
    coord = subprocess.Popen(
        [*cmd, "--clients", "1", "--png", ""],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert coord.stdout is not None
        lines = [coord.stdout.readline() for _ in range(2)]
        address = lines[1].split(": ", 1)[1].strip()
        other = SecretKey.generate().endpoint_id
        client = [sys.executable, "-m", "examples.federated.client", "--index", "0"]
        client += ["--clients", "1", "--coordinator", str(other), "--address", address]
        proc = subprocess.run(client, cwd=ROOT, capture_output=True, text=True, timeout=90)
    finally:
        coord.kill()
        coord.communicate(timeout=10)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "client 0: error: " in proc.stderr
