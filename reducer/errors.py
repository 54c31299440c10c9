"""The reducer's errors: one base, each subclass also the builtin a caller would catch."""

from __future__ import annotations

__all__ = ["ReducerError"]


class ReducerError(Exception):
    """Base of every error the reducer raises on purpose."""
