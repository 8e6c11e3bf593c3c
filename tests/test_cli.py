"""End-to-end tests of the ``p2pdist`` command line, run as a real subprocess."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pty
import re
import select
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from p2pdist.launch import LineSplitter, exit_status, rank_env

TIMEOUT_S = 60
ENDPOINT_ID = re.compile(r"^[a-z2-7]{52}$")


def run_cli(*args: str, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """Run ``python -m p2pdist.cli ARGS`` and capture its output."""
    return subprocess.run(
        [sys.executable, "-m", "p2pdist.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_version() -> None:
    proc = run_cli("--version")
    assert proc.returncode == 0
    assert proc.stdout.startswith("p2pdist ")


CHILD_OK = textwrap.dedent(
    """
    import os, sys
    peers = os.environ["P2PDIST_PEERS"].split(",")
    assert len(peers) == 3, peers
    assert len(set(peers)) == 3, peers
    assert os.environ["P2PDIST_TLS"] == "1"
    assert os.environ["P2PDIST_SEED"]
    print("rank", os.environ["P2PDIST_RANK"], "world", os.environ["P2PDIST_WORLD"])
    print("to stderr", file=sys.stderr)
    """
)


def test_launch_runs_all_ranks_with_prefixed_output() -> None:
    proc = run_cli("launch", "-n", "3", "--", sys.executable, "-c", CHILD_OK)
    assert proc.returncode == 0, proc.stderr
    out_lines = sorted(proc.stdout.splitlines())
    assert out_lines == [f"[rank {r}] rank {r} world 3" for r in range(3)]
    err_lines = sorted(proc.stderr.splitlines())
    assert err_lines == [f"[rank {r}] to stderr" for r in range(3)]


def test_launch_passes_seed_and_plaintext() -> None:
    code = "import os; print(os.environ['P2PDIST_SEED'], os.environ['P2PDIST_TLS'])"
    proc = run_cli(
        "launch",
        "-n",
        "2",
        "--plaintext",
        "--seed",
        "s3cr3t-seed",
        "--",
        sys.executable,
        "-c",
        code,
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == [f"[rank {r}] s3cr3t-seed 0" for r in range(2)]


def test_launch_handles_large_output_without_deadlock() -> None:
    code = "import sys; [print('x' * 100) for _ in range(20000)]; sys.stderr.write('e' * 300000)"
    proc = run_cli("launch", "-n", "2", "--", sys.executable, "-c", code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(proc.stdout.splitlines()) == 40000
    assert proc.stderr.count("e") >= 600000


def test_launch_writes_every_line_to_a_non_blocking_stdout() -> None:
    """A parent that left the launcher's stdout non-blocking (some CI runners do): when
    its reader lagged, writes failed with EAGAIN and were dropped as if the terminal had
    hung up (288 of 20,000 lines came through, exit 0: an audit)."""
    import fcntl

    r, w = os.pipe()
    fcntl.fcntl(w, fcntl.F_SETFL, fcntl.fcntl(w, fcntl.F_GETFL) | os.O_NONBLOCK)
    code = "for i in range(20000): print('%06d' % i + 'y' * 200)"
    cmd = [sys.executable, "-m", "p2pdist.cli", "launch", "-n", "1", "--"]
    proc = subprocess.Popen([*cmd, sys.executable, "-c", code], stdout=w)
    os.close(w)
    try:
        time.sleep(1.0)  # the reader lags: the pipe fills
        with os.fdopen(r, "rb") as f:
            data = f.read()
        assert proc.wait(timeout=TIMEOUT_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = data.decode().splitlines()
    assert lines == [f"[rank 0] {i:06d}" + "y" * 200 for i in range(20000)]


def test_launch_with_stdout_and_stderr_closed_still_runs_the_ranks(tmp_path: Path) -> None:
    """`p2pdist launch ... >&-` failed with an AttributeError traceback (sys.stdout is
    None then): an audit. The ranks run, their output goes nowhere."""
    mark = tmp_path / "ran"
    code = f"import pathlib; print('hi'); pathlib.Path({str(mark)!r}).touch()"
    launch = f"{sys.executable} -m p2pdist.cli launch -n 1 -- {sys.executable} -c {code!r}"
    proc = subprocess.run(["bash", "-c", f"{launch} >&- 2>&-"], timeout=TIMEOUT_S, check=False)
    assert proc.returncode == 0 and mark.exists()


CHILD_BOTH_STREAMS = textwrap.dedent(
    """
    import sys
    for i in range(1500):
        sys.stdout.write("O" * 900 + "\\n")
        sys.stderr.write("E" * 900 + "\\n")
    """
)


def test_launch_lines_stay_whole_when_stdout_and_stderr_are_one_pipe() -> None:
    """`p2pdist launch ... 2>&1 | tee log`: with a writer thread per stream, a write
    the full pipe took in pieces (over PIPE_BUF a write is not atomic) had the other
    stream's lines land inside it."""
    launch = [sys.executable, "-m", "p2pdist.cli", "launch", "-n", "2", "--"]
    proc = subprocess.Popen(
        [*launch, sys.executable, "-c", CHILD_BOTH_STREAMS],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    assert proc.stdout is not None
    data = bytearray()
    while chunk := proc.stdout.read1(16384):  # a slow reader: the pipe stays full
        data += chunk
        time.sleep(0.0005)
    assert proc.wait(timeout=TIMEOUT_S) == 0
    lines = bytes(data).splitlines()
    whole = re.compile(rb"\[rank [01]\] (O{900}|E{900})")
    torn = [line[:60] for line in lines if not whole.fullmatch(line)]
    assert len(lines) == 6000 and not torn, (len(lines), torn[:3])


def test_launch_of_a_command_that_cannot_start_exits_as_a_shell_does(tmp_path: Path) -> None:
    """A command not found exited 2, as a typo in the launcher's own flags does: scripts
    and shells expect 127 (not found) and 126 (found, cannot be run)."""
    script = tmp_path / "not-executable.sh"
    script.write_text("#!/bin/sh\necho never\n")
    for command, status in (("/nonexistent-p2pdist-command", 127), (str(script), 126)):
        proc = run_cli("launch", "-n", "2", "--", command)
        assert proc.returncode == status, proc.stderr
        assert f"cannot start {command!r}" in proc.stderr and "Traceback" not in proc.stderr
        assert "[rank" not in proc.stdout


def test_launch_says_which_inherited_settings_it_does_not_pass_on() -> None:
    """An exported P2PDIST_TLS=0 or P2PDIST_SEED was replaced without a word (the ranks
    ran TLS with a random seed), while a dropped P2PDIST_RELAY was announced."""
    env = {**os.environ, "P2PDIST_TLS": "0", "P2PDIST_SEED": "exported-seed-0123456789"}
    env["P2PDIST_RELAY"] = "https://relay.invalid/"
    cmd = [sys.executable, "-m", "p2pdist.cli", "launch", "-n", "1", "--"]
    shown = "sh", "-c", 'echo "$P2PDIST_TLS $P2PDIST_SEED"'
    proc = subprocess.run(
        [*cmd, *shown], env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert proc.returncode == 0, proc.stderr
    assert "not passing P2PDIST_RELAY on" in proc.stderr
    assert "not passing P2PDIST_TLS=0 on: the ranks run TLS" in proc.stderr
    assert "not passing P2PDIST_SEED on" in proc.stderr
    assert proc.stdout.startswith("[rank 0] 1 ") and "exported-seed" not in proc.stdout
    quiet = [*cmd[:-1], "--plaintext", "--seed", "s-0123456789abcdef", "--", *shown]
    agreed = subprocess.run(quiet, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert agreed.returncode == 0, agreed.stderr
    assert "P2PDIST_TLS" not in agreed.stderr and "P2PDIST_SEED" not in agreed.stderr
    assert agreed.stdout == "[rank 0] 0 s-0123456789abcdef\n"
    same = {**env, "P2PDIST_TLS": "off"}  # a yes/no the library reads as 0 agrees too
    off = subprocess.run(quiet, env=same, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert off.returncode == 0 and "P2PDIST_TLS" not in off.stderr, off.stderr


def test_launch_raises_its_open_files_limit_or_says_it_is_too_low() -> None:
    """Each rank holds two pipes in the launcher: under a low soft limit it raises the
    limit (up to the hard one), and when even that is too low it says so instead of
    blaming the command ("cannot start 'sleep': Too many open files": an audit)."""
    launch = f"{sys.executable} -m p2pdist.cli launch -n 30 -- sleep 1"
    raised = subprocess.run(
        ["bash", "-c", f"ulimit -S -n 40 && {launch}"],
        capture_output=True, text=True, timeout=TIMEOUT_S, check=False,
    )  # fmt: skip
    assert raised.returncode == 0, raised.stderr
    low = subprocess.run(
        ["bash", "-c", f"ulimit -n 40 && {launch}"],
        capture_output=True, text=True, timeout=TIMEOUT_S, check=False,
    )  # fmt: skip
    assert low.returncode == 2, low.stderr
    assert "too many open files" in low.stderr and "ulimit -n is 40" in low.stderr
    many = subprocess.run(  # more ranks than descriptors: the ports cannot be picked
        ["bash", "-c", f"ulimit -n 40 && {launch.replace('-n 30', '-n 100')}"],
        capture_output=True, text=True, timeout=TIMEOUT_S, check=False,
    )  # fmt: skip
    assert many.returncode == 2, many.stderr
    assert "cannot pick 100 ports: too many open files" in many.stderr, many.stderr


CHILD_FAIL = textwrap.dedent(
    """
    import os, sys, time
    rank = int(os.environ["P2PDIST_RANK"])
    print("pid", os.getpid(), flush=True)
    if rank == 1:
        time.sleep(0.5)
        sys.exit(3)
    time.sleep(60)
    """
)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_launch_failing_rank_stops_the_others() -> None:
    # The 20 s bound is far below the sleepers' 60 s: finishing at all proves they were stopped.
    proc = run_cli("launch", "-n", "3", "--", sys.executable, "-c", CHILD_FAIL, timeout=20)
    assert proc.returncode == 3
    assert "rank 1 exited with code 3" in proc.stderr
    assert "Traceback" not in proc.stderr
    pids = [int(m) for m in re.findall(r"^\[rank \d\] pid (\d+)$", proc.stdout, re.M)]
    assert len(pids) == 3
    assert not any(_pid_alive(pid) for pid in pids)


def test_launch_sees_a_ranks_exit_though_its_helper_holds_its_output() -> None:
    """Rank 1 starts a helper in the background (it inherits the rank's output) and
    fails: the launcher saw the exit only once the helper ended too (Process.wait waits
    for the pipes): it blamed rank 0 for a crash, or waited as long as the helper ran (an
    audit). The bound of 20 s is far below the helpers' 60 s."""
    script = '[ "$P2PDIST_RANK" = 1 ] && { sleep 60 & exit 5; }; sleep 60'
    proc = run_cli("launch", "-n", "2", "--", "sh", "-c", script, timeout=20)
    assert proc.returncode == 5, proc.stderr
    assert "rank 1 exited with code 5" in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["launch", "-n", "2"], "needs a command"),
        (["launch", "-n", "2", "--"], "needs a command"),
        (["launch", "-n", "0", "--", "true"], "must be 1 to 1024 on one machine"),
        (["launch", "-n", "100000", "--", "true"], "got 100000"),  # it hung binding ports
        (["launch", "-n", "2", "--seed", "short", "--", "true"], "at least 8 bytes"),
        (["launch", "-n", "2", "--host", "", "--", "true"], "--host must name"),
        (["keygen", "--out", ""], "--out needs a file name"),
        (["keygen", "--out", "/nonexistent-p2pdist-dir/k.pem"], "cannot write key file"),
    ],
)
def test_usage_errors(args: list[str], message: str) -> None:
    proc = run_cli(*args)
    assert proc.returncode == 2
    assert proc.stderr.startswith("p2pdist: error: ")
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_keygen_out_then_id(tmp_path: Path) -> None:
    key = tmp_path / "k.pem"
    gen = run_cli("keygen", "--out", str(key))
    assert gen.returncode == 0, gen.stderr
    eid = gen.stdout.strip()
    assert ENDPOINT_ID.match(eid)
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    shown = run_cli("id", str(key))
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.strip() == eid


def test_keygen_refuses_to_overwrite_without_force(tmp_path: Path) -> None:
    key = tmp_path / "k.pem"
    assert run_cli("keygen", "--out", str(key)).returncode == 0
    again = run_cli("keygen", "--out", str(key))
    assert again.returncode == 2
    assert "--force" in again.stderr
    forced = run_cli("keygen", "--out", str(key), "--force")
    assert forced.returncode == 0
    assert run_cli("id", str(key)).stdout.strip() == forced.stdout.strip()
    into_dir = run_cli("keygen", "--out", str(tmp_path), "--force")  # a directory
    assert into_dir.returncode == 2 and "cannot write key file" in into_dir.stderr
    assert "Traceback" not in into_dir.stderr


def test_keygen_to_stdout_then_id(tmp_path: Path) -> None:
    key = tmp_path / "k.pem"
    with key.open("wb") as f:
        os.fchmod(f.fileno(), 0o644)
        gen = subprocess.run(
            [sys.executable, "-m", "p2pdist.cli", "keygen"],
            stdout=f,
            stderr=subprocess.PIPE,
            text=True,
            timeout=TIMEOUT_S,
            check=False,
        )
    assert gen.returncode == 0, gen.stderr
    assert key.read_text().startswith("-----BEGIN PRIVATE KEY-----")
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    eid = gen.stderr.strip().rsplit(" ", 1)[-1]
    assert run_cli("id", str(key)).stdout.strip() == eid


def test_id_refuses_readable_key_file(tmp_path: Path) -> None:
    key = tmp_path / "k.pem"
    assert run_cli("keygen", "--out", str(key)).returncode == 0
    key.chmod(0o644)
    proc = run_cli("id", str(key))
    assert proc.returncode == 2
    assert proc.stderr.startswith("p2pdist: error: ")
    assert f"chmod 600 {key}" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_a_key_path_that_is_no_file_gets_no_chmod_advice(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)  # as /var/lib/p2pdist-relay might be
    for path, what in [(tmp_path, "is a directory, not a file"), ("/dev/null", "is a device")]:
        proc = run_cli("id", str(path))
        assert proc.returncode == 2 and what in proc.stderr, proc.stderr
        assert "chmod" not in proc.stderr and "Traceback" not in proc.stderr


def test_the_environment_is_read_strictly(monkeypatch: pytest.MonkeyPatch) -> None:
    from p2pdist import Group, UsageError

    base = {"P2PDIST_SEED": "s" * 20, "P2PDIST_RANK": "0", "P2PDIST_WORLD": "1"}
    for name, value in base.items():
        monkeypatch.setenv(name, value)
    for value, tls in [("OFF", False), ("False", False), ("no", False), ("Yes", True), ("", True)]:
        monkeypatch.setenv("P2PDIST_TLS", value)
        assert Group.from_env().config.transport.tls is tls, value
    monkeypatch.setenv("P2PDIST_TLS", "plain")
    with pytest.raises(UsageError, match="P2PDIST_TLS must be 1 or 0"):
        Group.from_env()
    monkeypatch.setenv("P2PDIST_TLS", "1")
    monkeypatch.setenv("P2PDIST_RELAY_TOKEN", "")  # unused without a relay: fine
    Group.from_env()
    monkeypatch.setenv("P2PDIST_RELAY", "https://127.0.0.1:9/")
    with pytest.raises(UsageError, match="P2PDIST_RELAY_TOKEN is set but empty"):
        Group.from_env()
    proc = subprocess.run(
        [sys.executable, "-m", "p2pdist.cli", "doctor", "--relay", "https://127.0.0.1:9/"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env={**os.environ, "P2PDIST_RELAY_TOKEN": ""},
    )
    assert proc.returncode == 2 and "P2PDIST_RELAY_TOKEN is set but empty" in proc.stderr


def test_rank_world_and_peers_from_the_environment_are_read_strictly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """int() took P2PDIST_RANK="0_1" as rank 1 and other scripts' digits, and an empty
    entry in P2PDIST_PEERS ("a,,b") was dropped, so a missing address went unnoticed when
    the count still matched (an audit)."""
    from p2pdist import Group, UsageError

    monkeypatch.setenv("P2PDIST_SEED", "s" * 20)
    monkeypatch.setenv("P2PDIST_WORLD", "3")
    monkeypatch.setenv("P2PDIST_PEERS", "127.0.0.1:1, 127.0.0.1:2,127.0.0.1:3,")
    for bad in ("0_1", "\u0661", "+1", "1.0", ""):
        monkeypatch.setenv("P2PDIST_RANK", bad)
        with pytest.raises(UsageError, match=r"must be non-negative decimal integers|is not set"):
            Group.from_env()
    monkeypatch.setenv("P2PDIST_RANK", " 1 ")
    assert Group.from_env().rank == 1  # spaces, and a trailing comma, are fine
    monkeypatch.setenv("P2PDIST_PEERS", "127.0.0.1:1,,127.0.0.1:3")
    with pytest.raises(UsageError, match="empty entry"):
        Group.from_env()


def test_the_group_constructor_takes_ranks_as_from_seed_does() -> None:
    """A numpy integer is a rank (it was refused as out of range) and a bool is not (True
    was taken as rank 1), as from_seed has them."""
    import numpy as np

    from p2pdist import Group, SecretKey, UsageError, derive_endpoint_ids

    ids = derive_endpoint_ids("s" * 20, 2)
    key = SecretKey.from_seed("s" * 20, 1)
    peers = ["127.0.0.1:1", "127.0.0.1:2"]
    g = Group(key, np.int64(1), ids, addresses=peers)  # type: ignore[arg-type]
    assert g.rank == 1 and type(g.rank) is int
    with pytest.raises(UsageError, match="rank must be an int, got bool True"):
        Group(key, True, ids, addresses=peers)
    with pytest.raises(UsageError, match=r"rank must be in \[0, 2\), got 2"):
        Group(key, 2, ids, addresses=peers)


def test_from_seed_names_wrong_types() -> None:
    from p2pdist import Group, UsageError

    with pytest.raises(UsageError, match="rank must be an int, got str '0'"):
        Group.from_seed("s" * 20, rank="0", world=2, peers=["a:1", "b:2"])  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="peers must be a list of host:port strings"):
        Group.from_seed("s" * 20, rank=0, world=2, peers="127.0.0.1:1,127.0.0.1:2")


def test_from_seed_refuses_a_relay_with_tcp_addresses() -> None:
    """relay= and peers= (or listen=) used to run through the relay and drop the
    addresses without a word; from_env already refused the pair."""
    from p2pdist import Group, SecretKey, UsageError

    url = f"https://127.0.0.1:4433/?pin={SecretKey.from_seed('r' * 20, 0).endpoint_id}"
    with pytest.raises(UsageError, match="peers= is for TCP: give one of relay= or peers="):
        Group.from_seed("s" * 20, rank=0, world=2, relay=url, peers=["a:1", "b:2"])
    with pytest.raises(UsageError, match="listen= is for TCP"):
        Group.from_seed("s" * 20, rank=0, world=2, relay=url, listen="0.0.0.0:7000")
    Group.from_seed("s" * 20, rank=0, world=2, relay=url)  # alone, it is fine


def test_id_missing_file() -> None:
    proc = run_cli("id", "/nonexistent/k.pem")
    assert proc.returncode == 2
    assert "does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_id_seed_world_lists_distinct_ids() -> None:
    proc = run_cli("id", "--seed", "a-long-enough-group-seed", "--world", "4")
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines()]
    assert [int(r[0]) for r in rows] == [0, 1, 2, 3]
    ids = [r[1] for r in rows]
    assert all(ENDPOINT_ID.match(i) for i in ids)
    assert len(set(ids)) == 4
    again = run_cli("id", "--seed", "a-long-enough-group-seed", "--world", "4")
    assert again.stdout == proc.stdout


def test_id_of_a_huge_world_streams_its_lines() -> None:
    """Every id was derived before the first was printed: a typo of a few zeros in
    --world looked like a hang, and then ran out of memory."""
    cmd = [sys.executable, "-m", "p2pdist.cli", "id", "--seed", "a-long-enough-seed"]
    proc = subprocess.Popen([*cmd, "--world", "1000000000"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], TIMEOUT_S)
        assert ready and proc.stdout.readline().startswith("0 ")
    finally:
        proc.kill()
        proc.wait(TIMEOUT_S)
    zero = run_cli("id", "--seed", "a-long-enough-seed", "--world", "0")
    assert zero.returncode == 2 and "--world must be >= 1, got 0" in zero.stderr


def test_id_allowlist_lines_are_what_the_relay_reads(tmp_path: Path) -> None:
    """`id --allowlist` prints lines a relay's allowlist file takes as they are (the
    plain `RANK ID` form is not one: the relay refuses a line that is not an id)."""
    from relay.access import AllowlistError, parse_allowlist

    plain = run_cli("id", "--seed", "a-long-enough-group-seed", "--world", "3")
    listed = run_cli("id", "--seed", "a-long-enough-group-seed", "--world", "3", "--allowlist")
    assert listed.returncode == 0, listed.stderr
    ids = [line.split()[1] for line in plain.stdout.splitlines()]
    assert listed.stdout.splitlines() == [f"{eid}  # rank {r}" for r, eid in enumerate(ids)]
    key = tmp_path / "node.key"
    assert run_cli("keygen", "--out", str(key)).returncode == 0
    one = run_cli("id", str(key), "--allowlist")
    assert one.returncode == 0, one.stderr
    text = listed.stdout + one.stdout
    parsed = parse_allowlist(text, "allowlist.txt")
    assert len(parsed) == 4
    # A file name cannot add a line (a reviewer's: a newline, then another id).
    sly = tmp_path / f"x\n{ids[0]}"
    key.rename(sly)
    tricked = run_cli("id", str(sly), "--allowlist")
    assert tricked.returncode == 0, tricked.stderr
    assert len(tricked.stdout.splitlines()) == 1, tricked.stdout
    with pytest.raises(AllowlistError):
        parse_allowlist(plain.stdout, "allowlist.txt")


def test_keygen_seed_prints_fresh_seed() -> None:
    first = run_cli("keygen", "--seed")
    second = run_cli("keygen", "--seed")
    assert first.returncode == 0 and second.returncode == 0
    seed = first.stdout.strip()
    assert len(seed) >= 40
    assert re.fullmatch(r"[0-9a-f]{64}", seed)
    assert seed != second.stdout.strip()
    ids = run_cli("id", "--seed", seed, "--world", "2")
    assert ids.returncode == 0, ids.stderr


def test_unknown_argument_is_a_usage_error() -> None:
    proc = run_cli("keygen", "--bogus")
    assert proc.returncode == 2
    assert "unrecognized arguments" in proc.stderr


def test_line_splitter_partial_and_long_lines() -> None:
    s = LineSplitter(max_line=8)
    assert s.feed(b"ab") == []
    assert s.feed(b"c\nde\nf") == [b"abc\n", b"de\n"]
    assert s.feed(b"ghijklm") == [b"fghijklm"]
    assert s.feed(b"n") == []
    assert s.flush() == [b"n"]
    assert s.flush() == []


def test_exit_status_and_rank_env() -> None:
    assert exit_status(3) == 3
    assert exit_status(-9) == 137
    base = {"X": "1", "P2PDIST_RELAY": "https://r:1/?pin=x", "P2PDIST_RELAY_TOKEN": "t"}
    base |= {"P2PDIST_LAN": "1", "P2PDIST_LISTEN": "0.0.0.0:7000"}
    env = rank_env(base, rank=1, world=2, seed="s", peers=["h:1", "h:2"], tls=False)
    # An exported relay URL or LAN flag would make Group.from_env refuse the peers, and
    # a listen address would make every rank listen on it.
    assert env == {
        "X": "1",
        "P2PDIST_RELAY_TOKEN": "t",  # conflicts with nothing: programs may use it
        "P2PDIST_SEED": "s",
        "P2PDIST_RANK": "1",
        "P2PDIST_WORLD": "2",
        "P2PDIST_PEERS": "h:1,h:2",
        "P2PDIST_TLS": "0",
    }


CHILD_WAITS = textwrap.dedent(
    """
    import os, sys, time
    path = os.path.join(sys.argv[1], os.environ["P2PDIST_RANK"] + ".pid")
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(path + ".tmp", path)
    time.sleep(60)
    """
)


def _start_waiting_ranks(tmp_path: Path, child: str, **popen: Any) -> tuple[Any, list[int]]:
    """A launcher of 2 ranks running ``child`` (given tmp_path), once both are up. If they
    do not come up, the launcher and whatever rank did start are stopped."""
    cmd = [sys.executable, "-m", "p2pdist.cli", "launch", "-n", "2", "--"]
    proc = subprocess.Popen([*cmd, sys.executable, "-c", child, str(tmp_path)], **popen)
    pid_files = [tmp_path / f"{r}.pid" for r in range(2)]
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not all(f.exists() for f in pid_files):
            assert proc.poll() is None, "the launcher ended before its ranks started"
            assert time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.05)
    except BaseException:
        _stop(proc, [int(f.read_text()) for f in pid_files if f.exists()])
        raise
    return proc, [int(f.read_text()) for f in pid_files]


def _gone(pids: list[int], within: float = TIMEOUT_S) -> bool:
    deadline = time.monotonic() + within
    for pid in pids:
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
    return True


def _stop(proc: Any, pids: list[int]) -> None:
    """Cleanup, whether the test passed or not: kill the ranks still there (they run in
    sessions of their own, so the launcher's death does not end them; they may also
    hold its pipes), then the launcher, and reap it."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.kill()
        proc.communicate(timeout=TIMEOUT_S)


CHILD_LEAVES_A_CHILD = textwrap.dedent(
    """
    import os, subprocess, sys, time
    rank = os.environ["P2PDIST_RANK"]
    bg = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    with open(os.path.join(sys.argv[1], f"bg{rank}.tmp"), "w") as f:
        f.write(str(bg.pid))
    os.rename(os.path.join(sys.argv[1], f"bg{rank}.tmp"), os.path.join(sys.argv[1], f"bg{rank}"))
    if rank == "0":  # fail only once every rank has its child
        while not os.path.exists(os.path.join(sys.argv[1], "bg1")):
            time.sleep(0.01)
        sys.exit(int(sys.argv[2]))
    """
)


@pytest.mark.parametrize("code", [0, 3])
def test_launch_leaves_no_child_of_a_rank_behind(tmp_path: Path, code: int) -> None:
    """A rank's background child dies with the launch, whether the ranks all succeed or
    one fails (the launcher used to signal only ranks still running, so the children
    of ranks that had exited, the failing one's included, lived on)."""
    proc = run_cli(
        "launch", "-n", "2", "--", sys.executable, "-c", CHILD_LEAVES_A_CHILD,
        str(tmp_path), str(code),
    )  # fmt: skip
    pids = [int(f.read_text()) for f in sorted(tmp_path.glob("bg?"))]
    try:
        assert proc.returncode == code, proc.stderr
        assert len(pids) == 2, proc.stderr
        assert _gone(pids, within=10), "a rank's background child outlived the launcher"
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


SUBREAPER_LAUNCH = textwrap.dedent(
    """
    import ctypes, sys
    assert ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # CHILD_SUBREAPER
    from p2pdist.launch import LaunchConfig, launch
    rank = (
        "import subprocess, sys; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(0.2)'])"
    )
    sys.exit(launch(LaunchConfig(command=(sys.executable, "-c", rank), nprocs=2, tls=False)))
    """
)


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_CHILD_SUBREAPER is Linux's")
def test_launch_as_a_subreaper_is_not_held_up_by_zombies() -> None:
    """A launcher that is PID 1 (a container) or a subreaper inherits the ranks' dead
    background children, which asyncio never reaps: their zombies kept the groups
    "alive", and teardown waited for SIGTERM and SIGKILL in vain."""
    proc = subprocess.run(
        [sys.executable, "-c", SUBREAPER_LAUNCH], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert "SIGKILL" not in proc.stderr and "still running" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM])
def test_launch_stops_every_rank_when_it_is_told_to_stop(tmp_path: Path, sig: int) -> None:
    """A closed terminal (SIGHUP) or a kill (SIGTERM) of the launcher stops the ranks,
    which run in sessions of their own and would otherwise be orphaned."""
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    proc, pids = _start_waiting_ranks(tmp_path, CHILD_WAITS, **pipes)
    try:
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=TIMEOUT_S)
        assert proc.returncode == 128 + sig, err
        # reaped by the launcher: gone, not orphaned
        assert _gone(pids), "a rank process outlived the launcher"
    finally:
        _stop(proc, pids)


def test_launch_survives_a_terminal_that_hung_up(tmp_path: Path) -> None:
    """After a hangup, writing to the terminal fails (EIO): the launcher must still stop
    its ranks and exit 128 + SIGHUP, not die on its own message."""
    master, slave = pty.openpty()
    try:
        proc, pids = _start_waiting_ranks(tmp_path, CHILD_WAITS, stdout=slave, stderr=slave)
    finally:
        os.close(slave)
    try:
        os.close(master)  # the terminal is gone
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(timeout=TIMEOUT_S) == 128 + signal.SIGHUP
        assert _gone(pids), "a rank outlived the launcher"
    finally:
        _stop(proc, pids)


CHILD_CHATTERS = textwrap.dedent(
    """
    import os, sys, time
    path = os.path.join(sys.argv[1], os.environ["P2PDIST_RANK"] + ".pid")
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(path + ".tmp", path)
    for i in range(600):
        print("step", i, flush=True)
        time.sleep(0.1)
    """
)


def test_launch_stops_its_ranks_when_its_reader_goes_away(tmp_path: Path) -> None:
    """`p2pdist launch ... | head -1`: the ranks ran on for as long as they liked, their
    output going nowhere; now they are stopped and the launcher exits 141 (SIGPIPE's)."""
    proc, pids = _start_waiting_ranks(
        tmp_path, CHILD_CHATTERS, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        assert b"step" in proc.stdout.readline()
        proc.stdout.close()  # the reader goes away
        err = proc.stderr.read()
        assert proc.wait(timeout=TIMEOUT_S) == 141, err
        assert _gone(pids), "a rank outlived the launcher"
        assert b"Traceback" not in err and b"Exception ignored" not in err, err
    finally:
        _stop(proc, pids)


def test_launch_killed_with_sigkill_still_stops_its_ranks(tmp_path: Path) -> None:
    """The ranks run in sessions of their own, so a launcher killed with SIGKILL (or by
    the OOM killer) used to leave them running: its guard now stops them."""
    proc, pids = _start_waiting_ranks(
        tmp_path, CHILD_WAITS, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        proc.kill()
        assert proc.wait(timeout=TIMEOUT_S) == -signal.SIGKILL
        assert _gone(pids), "a rank outlived a launcher killed with SIGKILL"
        assert proc.stderr is not None
        assert b"the launcher is gone" in proc.stderr.read()  # (the guard holds stderr)
    finally:
        _stop(proc, pids)


def test_launch_guard_keeps_the_groups_the_launcher_names() -> None:
    from p2pdist.launch_guard import Watch

    watch = Watch()
    for line in (b"+100\n", b"+200\n", b"-100\n", b"+1\n", b"+0\n", b"+x\n", b"?7\n"):
        watch.feed(line)
    assert watch.groups == {200} and not watch.done
    watch.feed(b"done\n")
    assert watch.done


def test_launch_guard_kills_a_group_that_ignores_sigterm() -> None:
    from p2pdist.launch_guard import stop_groups

    code = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('ready', flush=True); time.sleep(60)"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == b"ready\n"
        assert stop_groups({child.pid}, grace_s=0.3) == {child.pid}  # SIGKILL was needed
        assert child.wait(timeout=TIMEOUT_S) == -signal.SIGKILL
    finally:
        child.kill()
        child.communicate()


CHILD_FLOODS = textwrap.dedent(
    """
    import os, sys
    path = os.path.join(sys.argv[1], os.environ["P2PDIST_RANK"] + ".pid")
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(path + ".tmp", path)
    while True:
        print("x" * 100, flush=True)
    """
)


def test_launch_acts_on_a_signal_while_its_output_is_blocked(tmp_path: Path) -> None:
    """A paused terminal or a pipe nobody reads blocked the launcher in a write, and so
    it could not act on SIGTERM: now its output is written by threads, and it stops the
    ranks and exits 143 though its stdout never moves again."""
    proc, pids = _start_waiting_ranks(
        tmp_path, CHILD_FLOODS, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    try:
        time.sleep(0.5)  # the pipe to the test fills (it is never read)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=TIMEOUT_S) == 128 + signal.SIGTERM
        assert _gone(pids), "a rank outlived the launcher"
    finally:
        _stop(proc, pids)
        if proc.stdout is not None:
            proc.stdout.close()


CHILD_DUMPS = textwrap.dedent(
    """
    import os, signal, sys, time
    here = sys.argv[1]
    rank = os.environ["P2PDIST_RANK"]
    def dump(signum, frame):
        open(os.path.join(here, rank + ".quit"), "w").close()
        sys.exit(0)
    signal.signal(signal.SIGQUIT, dump)
    path = os.path.join(here, rank + ".pid")
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(path + ".tmp", path)
    time.sleep(60)
    """
)


def test_launch_passes_sigquit_on_to_its_ranks(tmp_path: Path) -> None:
    proc, pids = _start_waiting_ranks(
        tmp_path, CHILD_DUMPS, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        proc.send_signal(signal.SIGQUIT)
        assert proc.wait(timeout=TIMEOUT_S) == 128 + signal.SIGQUIT
        assert _gone(pids)
        assert sorted(p.name for p in tmp_path.glob("*.quit")) == ["0.quit", "1.quit"]
    finally:
        _stop(proc, pids)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["doctor", "--relay", "https://127.0.0.1:1/", "--timeout", "0"], "--timeout must be"),
        (["doctor", "--relay", "https://127.0.0.1:1/", "--serve", "--peer", "x"], "one of them"),
        (["doctor", "--relay", "https://127.0.0.1:1/", "--token", ""], "--token is empty"),
        (["bench", "-n", "1"], "-n must be at least 2"),
        (["bench", "--png", "/nonexistent-p2pdist-dir/x.png"], "no directory"),
    ],
)
def test_subcommands_refuse_bad_options_before_running(args: list[str], message: str) -> None:
    """One line and exit 2, before anything is measured or dialed (these used to give a
    traceback, or fail only after the whole run)."""
    proc = run_cli(*args)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_doctor_refuses_its_own_endpoint_id_as_the_peer_at_once(tmp_path: Path) -> None:
    """The same --key on both hosts (or one's own id pasted): the doctor dialled itself
    through the relay, found a "direct path" to itself and waited 30 s for a transfer no
    one answered. Now one line and exit 2, before the relay is dialled (port 1 here)."""
    from p2pdist.identity import SecretKey

    key = SecretKey.generate()
    key.save(tmp_path / "node.key")
    peer = str(key.endpoint_id)
    args = ["doctor", "--relay", "https://127.0.0.1:1/", "--key", str(tmp_path / "node.key")]
    proc = run_cli(*args, "--peer", peer)
    assert proc.returncode == 2, proc.stderr
    assert "own endpoint id" in proc.stderr and "Traceback" not in proc.stderr


def test_doctor_serve_that_cannot_reach_the_relay_exits_1_as_the_report_does() -> None:
    """--serve exited 2 ("another p2pdist error") where the report's exit 1 means the
    relay could not be reached (docs/operations.md)."""
    from p2pdist.identity import SecretKey

    pin = SecretKey.generate().endpoint_id
    relay = f"https://127.0.0.1:1/?pin={pin}"  # nothing listens on port 1
    proc = run_cli("doctor", "--relay", relay, "--timeout", "1", "--serve")
    assert proc.returncode == 1, proc.stderr
    assert "no session within 1 s" in proc.stderr and "Traceback" not in proc.stderr


async def test_a_transport_refuses_to_dial_its_own_endpoint_id() -> None:
    from p2pdist.errors import UsageError
    from p2pdist.identity import SecretKey
    from p2pdist.transport.quic import QuicTransport
    from p2pdist.transport.tcp import TcpTransport

    key = SecretKey.generate()
    for transport in (QuicTransport(key), TcpTransport(key)):
        try:
            address = await transport.listen("127.0.0.1", 0)
            with pytest.raises(UsageError, match="own endpoint id"):
                await asyncio.wait_for(transport.connect(key.endpoint_id, address), 10)
        finally:
            await transport.close()


def test_a_bad_loop_in_the_environment_is_one_line_before_any_rank_starts() -> None:
    """P2PDIST_LOOP=bogus: `bench` started its ranks, each failed with its own error and
    the launcher's status hid it; now one line and exit 2, before anything runs (and
    commands without an event loop do not care)."""
    env = {**os.environ, "P2PDIST_LOOP": "bogus"}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "p2pdist.cli", *args]
        return subprocess.run(
            cmd, capture_output=True, text=True, env=env, timeout=TIMEOUT_S, check=False
        )

    proc = run("bench", "-n", "2")
    assert proc.returncode == 2 and "[rank" not in proc.stderr, proc.stderr
    assert "P2PDIST_LOOP in the environment: event loop must be one of" in proc.stderr
    proc = run("id", "--seed", "a-long-enough-seed", "--world", "1")
    assert proc.returncode == 0, proc.stderr


def test_a_reader_that_goes_away_ends_the_command_as_sigpipe_would() -> None:
    """`p2pdist ... | head -1`: a BrokenPipeError traceback and status 1 before; now
    the status a SIGPIPE'd command has (141) and nothing on stderr."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "p2pdist.cli",
            "id",
            "--seed",
            "a-long-enough-seed",
            "--world",
            "200000",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline().startswith(b"0 ")
    proc.stdout.close()  # the reader goes away
    err = proc.stderr.read()
    assert proc.wait(timeout=TIMEOUT_S) == 141
    assert b"Traceback" not in err


def test_doctor_verdict_names_a_failed_peer_check_and_no_none() -> None:
    from p2pdist.doctor import DoctorReport, PeerReport, render
    from p2pdist.transport import LossInfo

    report = DoctorReport(
        "https://relay.test/",
        "a" * 52,
        relay_connected=True,
        relay_sees="192.0.2.1:5000",
        observation_off=True,
    )
    assert "local        not checked" in render(report)
    assert "None" not in render(report)
    report.peer = PeerReport("b" * 52, error="is not connected to the relay")
    assert report.verdict().endswith("but the check of peer bbbbbbbbbb failed (above)")
    report.peer = PeerReport("b" * 52, connected=True, direct=True, transfer_mb_s=9.0)
    assert "failed" not in report.verdict()
    report.peer.loss = LossInfo("bbr", packets_lost=12, spurious_losses=3, reordering=True)
    assert "8 MiB one way: 9.0 MB/s (bbr, 12 packets lost, 3 of them late: the path " in render(
        report
    )


def test_doctor_verdict_on_a_symmetric_nat_counts_a_global_ipv6_address() -> None:
    from p2pdist.doctor import DoctorReport

    report = DoctorReport(
        "https://relay.test/",
        "a" * 52,
        relay_connected=True,
        udp=True,
        mapping="endpoint-dependent",
        interfaces=["10.0.0.2"],
    )
    assert report.verdict().endswith("the rest stay relayed")
    report.interfaces.append("2001:db8:a::2")
    assert "peers with IPv6 may still go direct" in report.verdict()
    report.interfaces = ["10.0.0.2"]  # behind NAT66: only the relay's IPv6 ports tell
    report.mapping6 = "endpoint-independent"
    assert "peers with IPv6 may still go direct" in report.verdict()
    report.mapping6 = "endpoint-dependent"
    assert report.verdict().startswith("symmetric NAT on IPv4 and IPv6")
    report.mapping6 = "no UDP"  # asked over IPv6 (the relay has AAAA), no IPv6 here
    assert report.verdict().endswith("the rest stay relayed")
    report.mapping, report.mapping6 = "no UDP", "none (public address)"
    assert report.verdict() == (
        "UDP over IPv4 is blocked; over IPv6: no NAT: peers that can send to this address "
        "reach it directly"
    )


def test_doctor_shows_each_familys_observations_and_mapping() -> None:
    from p2pdist.doctor import DoctorReport, render

    report = DoctorReport(
        "https://relay.test/",
        "a" * 52,
        relay_connected=True,
        relay_sees="192.0.2.1:5000",
        udp=True,
        observation_ports=[3478, 3478],
        observation_ipv6=[False, True],
        observed=["192.0.2.1:5001", "no answer"],
        mapping="unknown",
        mapping6="no UDP",
    )
    text = render(report)
    assert "reachable: 192.0.2.1:5001 (port 3478), no answer (IPv6 port 3478)" in text
    assert "NAT mapping  unknown (IPv6: no UDP)" in text


def test_a_bad_proxy_in_the_environment_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from p2pdist import UsageError
    from p2pdist.transport.relay_path import RelayConfig

    monkeypatch.setenv("P2PDIST_RELAY_PROXY", "proxy:3128")
    with pytest.raises(UsageError, match="P2PDIST_RELAY_PROXY in the environment: proxy URL"):
        RelayConfig().chosen_proxy()
    assert RelayConfig(proxy="").chosen_proxy() is None  # "" overrides the environment


def test_doctor_refused_by_the_relay_says_so_and_shows_the_whole_id() -> None:
    """An allowlist relay refuses doctor's fresh key: the verdict said "cannot reach the
    relay", and the report showed 10 characters of an id the allowlist needs whole (an
    operator's trial)."""
    from p2pdist.doctor import DoctorReport, render

    report = DoctorReport(
        "https://relay.test/",
        "a" * 52,
        relay_error="refused us: endpoint not allowed",
        relay_refused=True,
    )
    text = render(report)
    assert "as " + "a" * 52 in text
    assert "cannot reach" not in report.verdict()
    assert report.verdict().startswith("the relay's allowlist refuses this key")
    assert "--key" in report.verdict()
    # Doctor's own fresh key: adding its id helps no one (a user trial: each run had
    # another id, and the verdict asked to allowlist it).
    report.fresh_key = True
    assert "made for this run only" in report.verdict()
    assert "add this endpoint id" not in report.verdict()
    proxied = DoctorReport(  # a proxy's 407 is no relay's refusal, nor a relay not there
        "https://relay.test/",
        "a" * 52,
        relay_error="proxy http://proxy.test:3128 refused the tunnel: 407",
        relay_denied=True,
        relay_refusal="proxy_refused",
    )
    assert proxied.verdict().startswith("the HTTP proxy refuses the tunnel to the relay")


async def test_doctor_against_a_relay_that_refuses_its_key(tmp_path: Path) -> None:
    from relay_helpers import running_relay

    from p2pdist.doctor import diagnose, render
    from p2pdist.identity import SecretKey

    allow = tmp_path / "allow.txt"
    allow.write_text(f"{SecretKey.generate().endpoint_id}\n")
    async with running_relay(allowlist=allow) as relay:
        key = SecretKey.generate()
        report = await diagnose(relay.url, key=key, timeout=5.0)
    assert report.relay_refused and not report.relay_connected, report
    assert report.relay_refusal == "not_allowed", report
    assert str(key.endpoint_id) in render(report)
    assert report.verdict().startswith("the relay's allowlist refuses this key")


async def test_doctor_without_a_token_is_told_the_relay_refuses_it() -> None:
    """A token relay refused doctor for want of one: the relay line said so, but the
    verdict read "cannot reach the relay" (a user trial); doctor without --key says
    its key is this run's only."""
    from relay_helpers import running_relay

    from p2pdist.doctor import diagnose
    from p2pdist.identity import SecretKey

    async with running_relay(token="a-long-enough-relay-token-0123456789") as relay:
        report = await diagnose(relay.url, timeout=5.0)
    assert report.relay_denied and not report.relay_refused and report.fresh_key, report
    assert report.relay_refusal == "bad_token", report
    assert report.verdict().startswith("the relay refuses this client"), report.verdict()
    assert "bad token" in (report.relay_error or ""), report
    # Not the pinned relay: we refused it, and the verdict says to check the pin.
    async with running_relay() as relay:
        base = relay.url.split("?")[0]
        wrong = await diagnose(f"{base}?pin={SecretKey.generate().endpoint_id}", timeout=5.0)
    assert wrong.relay_denied and "identity mismatch" in (wrong.relay_error or ""), wrong
    assert wrong.relay_refusal == "pin_mismatch", wrong
    assert wrong.verdict().startswith("the relay presented another key"), wrong.verdict()
