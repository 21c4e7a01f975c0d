"""trl-ext's loggers, the Hugging Face way: one root logger (`trl_ext`), a handler attached once, the level from
`TRL_EXT_LOG_LEVEL` (a bad value warns and keeps the default, never an error at import). Stdlib only.

The default level is `notice` (25, between `info` and `warning`): the few lines a user should see without asking
(each trainer's plugins and what `"auto"` chose, a flag that does not apply, what `uninstall()` leaves in place).
"""

from __future__ import annotations

import logging
import os

__all__ = ["LEVELS", "NOTICE", "get_logger", "is_main_process"]

_ROOT = "trl_ext"
_ENV = "TRL_EXT_LOG_LEVEL"
NOTICE = 25
DEFAULT_LEVEL = "notice"
#: The values `TRL_EXT_LOG_LEVEL` accepts (case-insensitive).
LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "notice": NOTICE,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}
_configured = False


def get_logger(name: str) -> logging.Logger:
    global _configured
    if not _configured:
        _configured = True
        if logging.getLevelName(NOTICE) != "NOTICE":
            logging.addLevelName(NOTICE, "NOTICE")
        root = logging.getLogger(_ROOT)
        if not root.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("[%(name)s|%(levelname)s] %(message)s"))
            root.addHandler(handler)
        raw = os.environ.get(_ENV) or ""
        value = raw.strip().lower() or DEFAULT_LEVEL
        root.setLevel(LEVELS.get(value, LEVELS[DEFAULT_LEVEL]))
        root.propagate = False
        if value not in LEVELS:
            root.warning(
                f"{_ENV}={raw!r} is not a log level; using {DEFAULT_LEVEL!r}. Use one of: {', '.join(LEVELS)}."
            )
    return logging.getLogger(name if name.startswith(_ROOT) else f"{_ROOT}.{name}")


def is_main_process(accelerator: object = None) -> bool:
    """Whether this is the main process: the accelerator's view if given, else the launcher's `RANK`."""
    if accelerator is not None and hasattr(accelerator, "is_main_process"):
        return bool(accelerator.is_main_process)
    for var in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        value = os.environ.get(var)
        if value is not None and value.strip().isdigit():
            return int(value) == 0
    return True
