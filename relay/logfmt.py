"""Structured log lines: ``event key=value key=value``, values quoted when needed."""

from __future__ import annotations

__all__ = ["kv"]


def _escape(ch: str) -> str:
    """One character of a quoted value: control characters (a client-sent request path
    may hold a CR that would forge a log line) as escapes, quote and backslash escaped."""
    if ch in '"\\':
        return "\\" + ch
    if ch == "\n":
        return "\\n"
    if ord(ch) < 0x20 or ord(ch) == 0x7F:
        return f"\\x{ord(ch):02x}"
    return ch


def _value(v: object) -> str:
    text = f"{v:.3f}" if isinstance(v, float) else str(v)
    if not text or any(ch in ' "=' or ord(ch) < 0x20 or ord(ch) == 0x7F for ch in text):
        return '"' + "".join(map(_escape, text)) + '"'
    return text


def kv(event: str, **fields: object) -> str:
    """``kv("auth_ok", conn="c7", id="abcdefghij")`` -> ``auth_ok conn=c7 id=abcdefghij``.

    Fields whose value is None are left out. Never pass secrets (tokens, keys).
    """
    parts = [event]
    parts.extend(f"{k}={_value(v)}" for k, v in fields.items() if v is not None)
    return " ".join(parts)
