"""Configuration from environment variables, each checked and named in its error."""

from __future__ import annotations

import math
import os

__all__ = ["env_choice", "env_flag", "env_float", "env_int"]


def env_int(name: str, default: int, *, minimum: int | None = None) -> int:
    """The integer value of environment variable ``name`` (``default`` if unset or empty)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw, 0)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, not {raw!r}") from None
    if minimum is not None and value < minimum:
        raise ValueError(f"environment variable {name} must be at least {minimum}, not {value}")
    return value


def env_float(name: str, default: float, *, minimum: float | None = None) -> float:
    """The float value of environment variable ``name`` (``default`` if unset or empty)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be a number, not {raw!r}") from None
    if not math.isfinite(value) or (minimum is not None and value < minimum):
        bound = f" >= {minimum}" if minimum is not None else ""
        raise ValueError(f"environment variable {name} must be a finite number{bound}, not {raw!r}")
    return value


def env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """One of ``choices`` (case-insensitive) from environment variable ``name``."""
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw not in choices:
        allowed = " or ".join(repr(c) for c in choices)
        raise ValueError(f"environment variable {name} must be {allowed}, not {raw!r}")
    return raw


def env_flag(name: str) -> bool:
    """True if environment variable ``name`` is set to something other than '' or '0'."""
    raw = os.environ.get(name, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"environment variable {name} must be 0 or 1, not {raw!r}")
