"""trl-ext's loggers, following the Hugging Face convention: one library root logger (`trl_ext`), a handler
attached once, the level taken from `TRL_EXT_LOG_LEVEL` (default `warning`). Stdlib only, so importing `trl_ext`
stays light."""

from __future__ import annotations

import logging
import os

_ROOT = "trl_ext"
_configured = False


def get_logger(name: str) -> logging.Logger:
    global _configured
    if not _configured:
        root = logging.getLogger(_ROOT)
        if not root.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("[%(name)s|%(levelname)s] %(message)s"))
            root.addHandler(handler)
        root.setLevel(os.environ.get("TRL_EXT_LOG_LEVEL", "warning").upper())
        root.propagate = False
        _configured = True
    return logging.getLogger(name if name.startswith(_ROOT) else f"{_ROOT}.{name}")
