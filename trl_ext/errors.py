"""trl-ext's two exception types: `UsageError` for the user's own settings, `InternalError` for trl-ext's bugs."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["REPORT", "InternalError", "UsageError", "did_you_mean"]

#: How every `InternalError` message ends.
REPORT = "this is a trl-ext bug; please report it"


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """` Did you mean `X`?` for the entry of `known` closest to a misspelled `name`, or "" when none is close."""
    import difflib

    close = difflib.get_close_matches(name, list(known), n=1)
    return f" Did you mean `{close[0]}`?" if close else ""


class UsageError(ValueError):
    """A flag, option, value, TRL version or combination that trl-ext cannot run correctly; the message names it and
    says what to do instead. A `ValueError`, as TRL's own configuration errors are."""


class InternalError(RuntimeError):
    """An invariant of trl-ext's own that does not hold (nothing the user sets causes or fixes it); the message ends
    with `REPORT`, on a line of its own after several lines. A `RuntimeError`, as Python's own errors of this kind."""

    def __init__(self, message: str) -> None:
        message = message.rstrip()
        if message.endswith(".") and not message.endswith(".."):  # one sentence, continued by REPORT
            message = message[:-1]
        super().__init__(f"{message}\n{REPORT}" if "\n" in message else f"{message}; {REPORT}")
