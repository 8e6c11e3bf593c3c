"""The benchmarks in benchmarks/ run and print their tables (tiny sizes, loopback only;
nat_lab.py, which needs root and minutes, is covered by the NAT-lab tests instead).

These are not measurements (sizes are far too small to mean anything); they keep the
commands that docs/performance.md quotes working, so a change that breaks a benchmark
fails CI instead of the next person who tries to reproduce a table. Gloo needs torch,
which is not a test dependency: the all-reduce benchmark must then say it skipped it.
Its Open MPI reference (a C program built with mpicc) runs wherever Open MPI is
installed, as scripts/test.sh does when it runs as root.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def bench(script: str, *args: str, timeout: float = 240) -> str:
    """Run ``benchmarks/<script> args``; its stdout (the test fails on a non-zero exit)."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def rates(line: str) -> list[float]:
    """The numbers of one table row after its label."""
    return [float(x) for x in re.findall(r"\d+\.\d+", line)]


@pytest.mark.timeout(300)
def test_allreduce_table_in_place_and_out_of_place() -> None:
    base = ["--world", "2", "--sizes", "4K", "64K", "--iters", "3", "--warmup", "1"]
    base += ["--modes", "plaintext", "tls", "--loop", "asyncio", "--no-tcp"]
    for extra in ([], ["--out-of-place", "--detail", "--rounds", "2"]):
        out = bench("allreduce.py", *base, *extra)
        assert "== world 2 ==" in out
        rows = {line.split()[0]: line for line in out.splitlines() if line.strip()}
        for size in ("4K", "64K"):
            # one bus bandwidth per mode (latencies print without a decimal point)
            assert len(rates(rows[size])) >= 2, out
        assert "barrier" in rows
        assert "failed" not in out, out
        aes = re.search(r"AES-256-GCM \(one core[^)]*\): (\d+\.\d+) GB/s", out)
        assert aes and float(aes.group(1)) > 0, out  # tls mode runs: its cipher's speed
        where = "out of place" if extra else "both in place"
        assert where in out
        assert ("2 rounds, the backends in turn" in out) == bool(extra), out
        # latency-bound sizes: each backend's least and greatest time over the rounds
        spread = re.search(r"least-greatest over the rounds: 4K: plaintext (\d+)-(\d+) us", out)
        assert (spread is not None) == bool(extra), out
        assert spread is None or int(spread.group(1)) <= int(spread.group(2))
        if "--detail" in extra:  # process CPU per call, per backend and size
            cpu = [ln for ln in out.splitlines() if ln.split()[:2] == ["plaintext", "64K"]]
            assert "cpu/rank (us)" in out and cpu and cpu[0].split()[-1] != "-", out
        try:
            import torch  # type: ignore[import-not-found,unused-ignore]  # noqa: F401
        except ImportError:
            assert "gloo: skipped" in out
        if shutil.which("mpicc") and shutil.which("mpirun"):  # CI installs Open MPI as root
            assert "over TCP (ompi)" in out and "ompi busbw" in out, out
            if "--detail" in extra:
                detail = [ln.split() for ln in out.splitlines()]
                for size in ("4K", "64K"):  # busbw and CPU per call
                    row = next(r for r in detail if r[:2] == ["ompi", size])
                    assert float(row[4]) > 0 and row[5] != "-", out
        else:
            print("Open MPI is not installed: only its skip note is checked")
            assert "ompi: skipped (mpicc" in out, out


@pytest.mark.timeout(300)
def test_allreduce_states_loopback_tcp_and_the_exchange_floor() -> None:
    args = ["--world", "2", "--sizes", "4K", "--iters", "3", "--warmup", "1"]
    args += ["--modes", "plaintext", "--loop", "asyncio", "--no-gloo", "--no-mpi"]
    out = bench("allreduce.py", *args)
    tcp = re.search(r"loopback TCP \(1 stream[^)]*\): (\d+\.\d+) GB/s", out)
    assert tcp and float(tcp.group(1)) > 0, out
    both = re.search(r"both ways at once \([^)]*\): (\d+\.\d+) GB/s each way", out)
    assert both and float(both.group(1)) > 0, out
    floor = re.search(r"exchange floor .*: blocking (\d+\.\d) us, asyncio (\d+\.\d) us", out)
    assert floor and 0 < float(floor.group(1)) < 50_000 and 0 < float(floor.group(2)) < 50_000
    if (ROOT / ".git").exists():  # the code a table measured: its commit
        assert re.search(r"p2pdist \S+ \(commit [0-9a-f]{7,}\+?\)", out), out


@pytest.mark.timeout(300)
def test_transport_throughput_one_way_and_both_ways() -> None:
    kinds = ["--kinds", "socket", "tls-socket", "p2pdist-plain", "p2pdist-tls"]
    for extra in ([], ["--both-ways"]):
        out = bench("transport_throughput.py", "--mib", "8", "--size-mib", "1", *kinds, *extra)
        row = next(line for line in out.splitlines() if "MiB" in line and "GB/s" not in line)
        assert len(rates(row)) == 4 and min(rates(row)) > 0, out  # one rate per column
        assert ("both at once" in out) == bool(extra)


@pytest.mark.timeout(300)
def test_quic_throughput_reports_cpu_per_megabyte_and_the_relay_ratio() -> None:
    out = bench("quic_throughput.py", "--repeat", "1", "--mib", "2", "--loop", "asyncio")
    rows = ["aioquic bare", "p2pdist QUIC direct", "p2pdist QUIC relay", "p2pdist TCP TLS"]
    rows += ["  QUIC direct, 1452 B datagrams", "  QUIC direct, 4 connections"]
    for row in rows:
        assert any(line.startswith(row) and "failed" not in line for line in out.splitlines()), out
    cpu = [line for line in out.splitlines() if "QUIC relay" in line and "sender" in line]
    assert cpu and "relay" in cpu[0].split("]", 1)[1], out  # the relay process's share too
    assert "relay / direct QUIC [asyncio]:" in out


@pytest.mark.timeout(300)
def test_reduce_modes_and_codecs_tables() -> None:
    out = bench("reduce_modes.py", "--world", "2", "--mib", "1", "--rounds", "1", "--iters", "1")
    for mode in ("plain", "det", "bf16", "int8", "f16"):
        assert re.search(rf"^\s+{mode}\s+\d", out, re.M), out
    out = bench("codecs.py", "--n", "65536", "--repeat", "1", "--iters", "1")
    assert "bfloat16" in out and "int8" in out


@pytest.mark.timeout(300)
def test_reduce_modes_on_shaped_links() -> None:
    """``--rate`` builds a LAN of namespaces whose links really are shaped: plain float32
    cannot beat the line rate there (a bound, not a timing: a slow machine only lowers
    it), and the LAN is gone afterwards."""
    from natlab import leftover_namespaces, require_shaping

    require_shaping()  # scripts/test.sh installs tc where CI runs as root
    args = ["--world", "2", "--mib", "1", "--rounds", "1", "--iters", "1", "--rate", "100mbit"]
    out = bench("reduce_modes.py", *args, "--modes", "plain", "bf16")
    assert "links shaped to 100 Mbit/s each way" in out, out
    plain = next(line.split() for line in out.splitlines() if line.split()[:1] == ["plain"])
    seconds = float(plain[1]) / 1e3  # the time column (ms, two decimals): busbw's source
    busbw_bytes = (1 << 20) / seconds  # world 2: bus bandwidth = bytes / time
    assert 0 < busbw_bytes <= 100e6 / 8 * 1.1, out
    assert re.search(r"^\s+bf16\s+\d", out, re.M), out
    assert not [ns for ns in leftover_namespaces() if ns.endswith("-switch")], "LAN left behind"


@pytest.mark.timeout(300)
def test_relay_datagrams_table() -> None:
    out = bench("relay_datagrams.py", "--count", "300", "--sizes", "1200", "--loop", "asyncio")
    row = out.splitlines()[-1].split()
    assert row[:2] == ["asyncio", "1200"], out
    received, sent = map(int, row[2].split("/"))
    assert sent == 300 and 0 < received <= sent, out


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("client", "clients"), [("test", 20), ("relaypath", 500)])
def test_relay_capacity_table(client: str, clients: int) -> None:
    """With p2pdist's own client, the issue's capacity: one relay holds 500 authenticated
    clients at once, each one's light traffic arriving (the memory and rate figures are
    the benchmark's to print, not this test's to judge)."""
    args = ["--clients", str(clients), "--light-seconds", "1", "--blast-pairs", "2"]
    args += ["--blast-seconds", "1", "--loop", "asyncio", "--client", client]
    out = bench("relay_capacity.py", *args)
    row = next(
        line.split() for line in out.splitlines() if line.split()[:2] == ["asyncio", str(clients)]
    )
    assert row[6] == f"{clients}/{clients}", out  # every light-traffic datagram arrived
    assert float(row[7]) > 0, out  # forwarded datagrams per second


@pytest.mark.parametrize(
    ("script", "args", "message"),
    [
        ("codecs.py", ["--n", "-5"], "--n must be at least 1"),
        ("codecs.py", ["--iters", "0"], "--iters must be at least 1"),
        ("codecs.py", ["--repeat", "0"], "--repeat must be at least 1"),
        ("reduce_modes.py", ["--world", "1"], "--world sizes must be at least 2"),
        ("reduce_modes.py", ["--mib", "0"], "--mib sizes must be positive"),
        ("reduce_modes.py", ["--rounds", "0"], "--rounds must be at least 1"),
        ("allreduce.py", ["--arrays", "cuda", "--no-gloo", "--no-mpi"], "needs CuPy"),
    ],
)
def test_benchmarks_refuse_bad_arguments_in_one_line(
    script: str, args: list[str], message: str
) -> None:
    """These were tracebacks, tables of zeros, or a FAILED cell per rank."""
    if "cuda" in args and importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed here: --arrays cuda is valid")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
