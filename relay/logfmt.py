"""Structured log lines: ``event key=value key=value``, values quoted when needed."""

from __future__ import annotations

__all__ = ["kv"]


def _value(v: object) -> str:
    text = f"{v:.3f}" if isinstance(v, float) else str(v)
    if not text or any(ch in text for ch in ' "=\n\t'):
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return text


def kv(event: str, **fields: object) -> str:
    """``kv("auth_ok", conn="c7", id="abcdefghij")`` -> ``auth_ok conn=c7 id=abcdefghij``.

    Fields whose value is None are left out. Never pass secrets (tokens, keys).
    """
    parts = [event]
    parts.extend(f"{k}={_value(v)}" for k, v in fields.items() if v is not None)
    return " ".join(parts)
