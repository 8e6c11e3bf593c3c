"""docker/Dockerfile and docker/compose.yaml, run without a Docker engine.

The compose demo (a relay on two networks, one rank on each, the ranks unable to reach
each other) is rebuilt from network namespaces (tests/natlab.py, both sides behind
symmetric NATs so no direct path can form), and every command, flag, environment
variable, volume path and port is taken from the two files: the relay's entrypoint with
the compose command, the image's HEALTHCHECK with the image's environment, the ranks'
shell command reading the relay URL from the shared volume, the stop signal. What
this cannot check is the image build itself (base image, pip install, user creation).
Runs as root (CI); skips with the reason elsewhere.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from container_spec import Dockerfile, compose_networks, compose_services, substitute
from natlab import NatLab, require_root
from relay_helpers import read_relay_url

from p2pdist.wire.relay import RelayUrl

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
BIN = Path(sys.executable).parent
SIDES = {"side-a": "a", "side-b": "b"}


@pytest.fixture(autouse=True)
def _root() -> None:
    require_root()


def _volumes(service: dict[str, object], tmp: Path) -> dict[str, Path]:
    """Container path -> host directory for the service's named volumes."""
    out = {}
    for spec in service.get("volumes", []):  # type: ignore[attr-defined]
        name, target = str(spec).split(":")[:2]
        host = tmp / "volumes" / name
        host.mkdir(parents=True, exist_ok=True)
        out[target] = host
    return out


def _paths(text: str, mounts: dict[str, Path]) -> str:
    for target, host in mounts.items():
        text = text.replace(target, str(host))
    return text


def _env(image: Dockerfile, service: dict[str, object]) -> dict[str, str]:
    env = {**os.environ, **image.env, "PATH": f"{BIN}:{os.environ.get('PATH', '')}"}
    for name, value in dict(service.get("environment", {})).items():  # type: ignore[call-overload]
        env[str(name)] = substitute(str(value), {})
    return env


def _hosts_file(ns: str, relay_ip: str) -> Path:
    """``ip netns exec`` bind-mounts /etc/netns/NS/hosts over /etc/hosts: the compose
    service name ``relay`` resolves there as Docker's DNS would resolve it."""
    folder = Path("/etc/netns") / ns
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "hosts").write_text(f"127.0.0.1 localhost\n{relay_ip} relay\n")
    return folder


def _listening(lab: NatLab) -> set[str]:
    out = subprocess.run(
        [*lab.exec_prefix("internet"), "ss", "-H", "-l", "-n", "-t", "-u"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    found = set()
    for line in out.splitlines():
        fields = line.split()
        proto = fields[0]
        port = fields[4].rsplit(":", 1)[1]
        found.add(f"{port}/{proto}")
    return found


def test_image_runs_unprivileged_ports_and_user() -> None:
    image = Dockerfile.read(DOCKER / "Dockerfile")
    assert image.user and image.user.split(":")[0] not in ("root", "0")
    assert image.entrypoint == ["p2pdist-relay"]
    assert (BIN / image.entrypoint[0]).exists(), "the entrypoint is the package's console script"
    for entry in image.expose:
        assert int(entry.split("/")[0]) >= 1024, f"{entry}: a non-root user cannot bind it"


def test_compose_demo_in_namespaces(tmp_path: Path) -> None:
    image = Dockerfile.read(DOCKER / "Dockerfile")
    services = compose_services(DOCKER / "compose.yaml")
    relay = services["relay"]
    ranks = {name: s for name, s in services.items() if name != "relay"}
    assert len(ranks) == 2
    # Each rank alone on an internal network the relay joins: no route between the
    # ranks on any engine (podman routes between plain bridges), so the demo is relayed.
    networks = compose_networks(DOCKER / "compose.yaml")
    rank_networks = [n for rank in ranks.values() for n in rank["networks"]]
    assert len(set(rank_networks)) == len(rank_networks) == 2
    for name in rank_networks:
        assert networks[name].get("internal") is True, name
        assert name in relay["networks"]

    with NatLab("symmetric", "symmetric", workdir=tmp_path) as lab:
        folders = [_hosts_file(lab.host_ns(side), lab.relay_ip) for side in ("a", "b")]
        try:
            # The relay: the image's entrypoint with the compose command, in its volumes.
            mounts = _volumes(relay, tmp_path)
            data = mounts.get("/data", tmp_path / "data")
            data.mkdir(exist_ok=True)
            argv = [str(BIN / image.entrypoint[0])]
            argv += [_paths(str(a), mounts) for a in relay.get("command", image.cmd)]
            log = (tmp_path / "relay.log").open("wb")
            proc = lab.spawn(
                "internet",
                argv,
                cwd=data,
                env=_env(image, relay),
                stdout=subprocess.PIPE,
                stderr=log,
            )
            assert proc.stdout is not None
            try:
                url = read_relay_url(proc.stdout, 30)
            except ValueError as exc:
                pytest.fail(f"{exc}; log:\n{(tmp_path / 'relay.log').read_text()}")
            assert RelayUrl.parse(url).host == "relay"  # --public-host=relay
            assert (mounts["/shared"] / "relay.url").read_text().strip() == url

            # The image's HEALTHCHECK, with the image's environment.
            check = [sys.executable if a == "python" else a for a in image.healthcheck]
            done = subprocess.run(
                [*lab.exec_prefix("internet"), *check],
                env=_env(image, relay),
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert done.returncode == 0, done.stdout + done.stderr

            # Published ports = exposed ports = what the relay bound.
            # The demo publishes on the host's loopback only: it opens no relay to the
            # network ("HOST_IP:HOST_PORT:CONTAINER_PORT/PROTO").
            assert all(str(p).startswith("127.0.0.1:") for p in relay["ports"])
            published = {str(p).rsplit(":", 1)[1].split()[0] for p in relay["ports"]}
            assert published == image.expose
            assert image.expose <= _listening(lab)

            # The two ranks: compose's shell command, each on its own network.
            procs = {}
            for name, rank in ranks.items():
                (network,) = rank["networks"]
                rank_mounts = _volumes(rank, tmp_path) | {"/app": ROOT}
                command = [_paths(substitute(str(c), {}), rank_mounts) for c in rank["command"]]
                procs[name] = lab.spawn(
                    SIDES[network],
                    [*rank["entrypoint"], *command],
                    env=_env(image, rank),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            for name, p in procs.items():
                try:
                    out, _ = p.communicate(timeout=120)
                except subprocess.TimeoutExpired:
                    p.kill()
                    out, _ = p.communicate(timeout=10)
                assert p.returncode == 0, f"{name}:\n{out}"
                assert "all_reduce sum = [3. 3. 3. 3.]" in out, out

            # docker stop: the image's STOPSIGNAL, within the compose grace period.
            proc.send_signal(getattr(signal, image.stopsignal))
            grace = float(str(relay.get("stop_grace_period", "10s")).rstrip("s"))
            assert proc.wait(grace) == 0
            relay_log = (tmp_path / "relay.log").read_text()
            assert relay_log.count(" auth_ok ") == 2 and " stopped" in relay_log, relay_log
        finally:
            for folder in folders:
                for f in folder.iterdir():
                    f.unlink()
                folder.rmdir()
