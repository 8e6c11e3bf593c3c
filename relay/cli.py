"""Command line and config file: flags override the TOML file, which overrides defaults.

The token may also come from the environment (``P2PDIST_RELAY_TOKEN``), which sits
between the file and the flags, so that it need not appear in ``ps`` output or on disk.
Set but empty, it is the same error as ``--token ""`` (never a silent "no token").
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from p2pdist import __version__

from .config import (
    TOKEN_ENV,
    ConfigError,
    RelayConfig,
    coerce,
    normalize_keys,
)
from .logfmt import kv

__all__ = ["build_parser", "load_config", "read_config_file"]


def build_parser() -> argparse.ArgumentParser:
    """The ``p2pdist-relay`` argument parser (every flag defaults to 'not given')."""
    p = argparse.ArgumentParser(
        prog="p2pdist-relay",
        description="Self-hosted p2pdist relay: forwards end-to-end encrypted datagrams "
        "between authenticated endpoints. Prints 'relay url: URL' once listening.",
        argument_default=argparse.SUPPRESS,
    )
    p.add_argument(
        "--config",
        metavar="FILE.toml",
        help="TOML file with the same settings (flags given as well override it)",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    for f in dataclasses.fields(RelayConfig):
        flag = "--" + f.name.replace("_", "-")
        text = f.metadata["help"]
        if f.default is not None:
            text += f" [default: {f.default}]"
        p.add_argument(flag, dest=f.name, metavar=f.metadata.get("metavar"), help=text)
    return p


def read_config_file(path: Path) -> dict[str, Any]:
    """Raw settings from a TOML file, keyed by field name."""
    try:
        raw = path.read_bytes()
        # A byte-order mark, as some editors write (the allowlist takes one too).
        data = tomllib.loads(raw.removeprefix(b"\xef\xbb\xbf").decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:  # TOML is UTF-8 only
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    return normalize_keys(data, f"config file {path}")


def load_config(
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    warnings: list[str] | None = None,
) -> RelayConfig:
    """Parse flags, read ``--config`` if given, apply the environment; ConfigError on
    anything wrong (argparse itself exits with status 2 on unknown flags). What is
    allowed but unwise (a token in a file others may read) is appended to ``warnings``
    as ``event key=value`` lines, for the caller to log once logging is set up."""
    env = os.environ if environ is None else environ
    args = vars(build_parser().parse_args(argv))
    config_path = args.pop("config", None)
    merged: dict[str, Any] = {}
    file_values: dict[str, Any] = {}
    base: Path | None = None
    if config_path is not None:
        path = Path(config_path).expanduser()
        file_values = read_config_file(path)
        base = path.resolve().parent
        if "token" in file_values and warnings is not None:
            with contextlib.suppress(OSError):
                mode = path.stat().st_mode & 0o777
                if mode & 0o044:  # readable by group or others
                    hint = "others on this host can read the token: chmod 600 it"
                    warnings.append(
                        kv("token_file_readable", path=path, mode=f"{mode:o}", hint=hint)
                    )
    if TOKEN_ENV in env:  # set but empty is an error, as --token "" is
        merged["token"] = env[TOKEN_ENV]
    merged.update(args)
    # The file's paths are relative to the file, the flags' to the working directory;
    # validation happens once, on the merged result.
    given = {name for name, value in merged.items() if value is not None}
    from_file = {name for name in file_values if name not in given}
    try:
        typed = coerce(file_values, base=base, text=False)
    except ConfigError as exc:  # a value of the wrong kind in the file
        raise ConfigError(f"config file {config_path}: {exc}") from None
    try:
        return RelayConfig(**{**typed, **coerce(merged)})
    except ConfigError as exc:
        # A value the file gave (and no flag or variable replaced) is the file's to fix.
        setting = str(exc).split(" ", 1)[0].rstrip(":").replace("-", "_")
        if setting in from_file:
            raise ConfigError(f"config file {config_path}: {exc}") from None
        raise
