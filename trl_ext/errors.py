"""The one exception type users of trl-ext see for their own mistakes."""

from __future__ import annotations

__all__ = ["UsageError"]


class UsageError(ValueError):
    """A flag, option, value, TRL version or combination that trl-ext cannot run correctly.

    The message always names the flag (or plugin) and says what to do instead. It subclasses `ValueError` so code
    that already catches TRL's own configuration errors keeps working.
    """
