"""trl-ext's two exception types: `UsageError` for the user's own settings, `InternalError` for trl-ext's bugs."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["REPORT", "InternalError", "UsageError", "did_you_mean"]

#: How every `InternalError` message ends.
REPORT = "this is a trl-ext bug; please report it"


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """` Did you mean `X`?` for the entry of `known` closest to a misspelled `name` (a flag, a plugin, a loss type),
    or "" when none is close: the one hint every unknown name of the user's gets."""
    import difflib

    close = difflib.get_close_matches(name, list(known), n=1)
    return f" Did you mean `{close[0]}`?" if close else ""


class UsageError(ValueError):
    """A flag, option, value, TRL version or combination that trl-ext cannot run correctly.

    The message always names the flag (or plugin) and says what to do instead. It subclasses `ValueError` so code
    that already catches TRL's own configuration errors keeps working.
    """


class InternalError(RuntimeError):
    """An invariant of trl-ext's own that does not hold: nothing the user set can cause it, so nothing the user sets
    fixes it. The message says what broke and ends with `REPORT` (a message on several lines gets it on a line of its
    own). A `RuntimeError`, as Python's own errors of this kind are.
    """

    def __init__(self, message: str) -> None:
        message = message.rstrip()
        if message.endswith(".") and not message.endswith(".."):  # one sentence, continued by REPORT
            message = message[:-1]
        super().__init__(f"{message}\n{REPORT}" if "\n" in message else f"{message}; {REPORT}")
