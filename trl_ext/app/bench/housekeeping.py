"""What a bench run changes around it and puts back: the log levels of the libraries while its own trainers run (one
progress line per step of the bench, not three notices per trainer it builds), and the folders it made and left empty
(trainers' `output_dir`s that `save_strategy="no"` never writes to, torchrun's per-attempt folders, torch's cache
folder) once it finishes or fails. A folder that was there before the run is never removed.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

#: The environment variable that sets trl-ext's log level (`trl_ext._logging`): a user who sets it sees that level.
LOG_LEVEL_ENV = "TRL_EXT_LOG_LEVEL"
#: DeepSpeed's logger: on import it warns that it set its accelerator to the CPU, which the CPU bench means to do.
DEEPSPEED_LOGGER = "DeepSpeed"


class _Below(logging.Filter):
    """Drops the records under a level (a logger's own level would be reset by the library that creates it)."""

    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= self.level


@contextlib.contextmanager
def quiet_logs() -> Iterator[None]:
    """The bench's trainers are the bench's business: while it runs, trl-ext logs at `warning` (not the notices of
    every trainer it builds: which plugins it got, what `"auto"` chose, what `uninstall()` leaves; a warning a user
    must act on still shows), transformers at `error` and DeepSpeed at `error`; the libraries' `FutureWarning`s and
    TRL's note on `trl.experimental` are not shown. `TRL_EXT_LOG_LEVEL`, when set, wins.
    Everything is put back on exit."""
    from transformers.utils import logging as hf_logging

    from ..._logging import get_logger

    root = get_logger("trl_ext")  # configures trl-ext's handler and level first, so that the level set here holds
    level = root.level
    if not os.environ.get(LOG_LEVEL_ENV, "").strip():
        root.setLevel(logging.WARNING)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    deepspeed = logging.getLogger(DEEPSPEED_LOGGER)
    below = _Below(logging.ERROR)
    deepspeed.addFilter(below)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*trl.experimental.*")
            warnings.filterwarnings("ignore", category=FutureWarning)  # the libraries' deprecation notes, not ours
            yield
    finally:
        deepspeed.removeFilter(below)
        hf_logging.set_verbosity(verbosity)
        root.setLevel(level)


@contextlib.contextmanager
def no_empty_folders(out: Path) -> Iterator[Path]:
    """Runs the bench with a temporary folder of its own (`TMPDIR` for it and the processes it launches; yielded) and
    afterwards, whether it finished or failed, removes the empty folders it made: in `out` (what it added there, and
    `out` itself when it made it and left it empty) and its temporary folder (at exit, when a library still holds a
    file there: `datasets` keeps its cache files until the process ends)."""
    made_out = not out.exists()
    before = set(os.listdir(out)) if out.is_dir() else set()
    scratch = Path(tempfile.mkdtemp(prefix="trl-ext-bench-"))
    saved_env, saved_tempdir = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = tempfile.tempdir = str(scratch)
    try:
        yield scratch
    finally:
        tempfile.tempdir = saved_tempdir
        if saved_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved_env
        if out.is_dir():
            for name in sorted(set(os.listdir(out)) - before):
                remove_empty(out / name)
            if made_out:
                remove_empty(out)
        if remove_empty(scratch):
            atexit.register(shutil.rmtree, scratch, ignore_errors=True)


def remove_empty(folder: Path) -> bool:
    """Removes the empty folders in `folder`, deepest first, and `folder` itself if it ends empty; whether something
    (a file) is left. A file, a link or a missing path is left alone."""
    if folder.is_symlink() or not folder.is_dir():
        return folder.exists()
    left = False
    for entry in folder.iterdir():
        left = remove_empty(entry) or left
    if not left:
        with contextlib.suppress(OSError):  # a file appeared meanwhile: keep the folder
            folder.rmdir()
    return folder.exists()
