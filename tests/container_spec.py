"""What docker/Dockerfile and docker/compose.yaml ask a container engine to run.

No Docker engine runs on the test machines, so tests/test_container.py runs the same
commands, environment and ports in network namespaces instead. This module reads them
from the files themselves, so a flag renamed in the relay or a typo in either file fails
a test rather than a user's ``docker compose up``.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

__all__ = ["Dockerfile", "compose_networks", "compose_services", "substitute"]


@dataclass
class Dockerfile:
    """The instructions of a Dockerfile that say how its container runs."""

    env: dict[str, str] = field(default_factory=dict)
    user: str = ""
    expose: set[str] = field(default_factory=set)
    """``"8443/tcp"``-style entries (a bare port means tcp, as in Docker)."""
    healthcheck: list[str] = field(default_factory=list)
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    stopsignal: str = "SIGTERM"

    @classmethod
    def read(cls, path: Path) -> Dockerfile:
        """Parse ``path`` (continuation lines joined, comments skipped)."""
        spec = cls()
        for keyword, args in _instructions(path.read_text()):
            if keyword == "ENV":
                for pair in shlex.split(args):
                    name, sep, value = pair.partition("=")
                    if not sep:
                        raise ValueError(f"ENV without '=' is not supported here: {pair!r}")
                    spec.env[name] = value
            elif keyword == "USER":
                spec.user = args.strip()
            elif keyword == "EXPOSE":
                spec.expose |= {p if "/" in p else f"{p}/tcp" for p in args.split()}
            elif keyword == "HEALTHCHECK":
                _, _, command = args.partition("CMD")
                spec.healthcheck = _exec_form(command, keyword)
            elif keyword == "ENTRYPOINT":
                spec.entrypoint = _exec_form(args, keyword)
            elif keyword == "CMD":
                spec.cmd = _exec_form(args, keyword)
            elif keyword == "STOPSIGNAL":
                spec.stopsignal = args.strip()
        return spec


def _instructions(text: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, args = (pending + line).partition(" ")
        out.append((keyword.upper(), args.strip()))
        pending = ""
    return out


def _exec_form(args: str, keyword: str) -> list[str]:
    value = json.loads(args.strip())
    if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise ValueError(f"{keyword} must use the exec form (a JSON list of strings)")
    return value


def compose_services(path: Path) -> dict[str, dict[str, Any]]:
    """The services of a compose file, with YAML anchors and ``<<`` merges resolved."""
    data = yaml.safe_load(path.read_text())
    services = data["services"]
    assert isinstance(services, dict)
    return services


def compose_networks(path: Path) -> dict[str, dict[str, Any]]:
    """The top-level networks of a compose file (``{}`` for one declared bare)."""
    data = yaml.safe_load(path.read_text())
    return {name: spec or {} for name, spec in (data.get("networks") or {}).items()}


_VAR = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}")


def substitute(value: str, env: dict[str, str]) -> str:
    """Compose's variable interpolation: ``${NAME:-default}`` and ``$$`` for ``$``."""
    value = _VAR.sub(lambda m: env.get(m.group(1)) or (m.group(2) or ""), value)
    return value.replace("$$", "$")
