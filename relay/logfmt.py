"""Structured log lines: ``event key=value key=value``, values quoted when needed."""

from __future__ import annotations

__all__ = ["kv"]


def _escape(ch: str) -> str:
    """One character of a quoted value: what is not printable (a CR or a line separator
    in a client-sent request path could forge a log line) as an escape, quote and
    backslash escaped."""
    if ch in '"\\':
        return "\\" + ch
    if ch == "\n":
        return "\\n"
    if not ch.isprintable():
        return f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}"
    return ch


def _value(v: object) -> str:
    text = f"{v:.3f}" if isinstance(v, float) else str(v)
    if not text or not text.isprintable() or any(ch in ' "=' for ch in text):
        return '"' + "".join(map(_escape, text)) + '"'
    return text


def kv(event: str, **fields: object) -> str:
    """``kv("auth_ok", conn="c7", id="abcdefghij")`` -> ``auth_ok conn=c7 id=abcdefghij``.

    Fields whose value is None are left out. Never pass secrets (tokens, keys).
    """
    parts = [event]
    parts.extend(f"{k}={_value(v)}" for k, v in fields.items() if v is not None)
    return " ".join(parts)
