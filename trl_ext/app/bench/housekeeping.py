"""What a bench run changes around it and puts back: the libraries' log levels while its own trainers run, and the
folders it made and left empty (trainers' unused `output_dir`s, torchrun's per-attempt folders, torch's cache folder)
once it finishes or fails. A folder that was there before the run is never removed."""

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


@contextlib.contextmanager
def quiet_logs() -> Iterator[None]:
    """While the bench runs, trl-ext logs at `warning` (not the notices of every trainer it builds; a warning a user
    must act on still shows), transformers and DeepSpeed at `error`, and the libraries' `FutureWarning`s and TRL's
    note on `trl.experimental` are not shown; `TRL_EXT_LOG_LEVEL`, when set, wins. All put back on exit."""
    from transformers.utils import logging as hf_logging

    from ..._logging import get_logger

    root = get_logger("trl_ext")  # configures trl-ext's handler and level first, so that the level set here holds
    level = root.level
    if not os.environ.get(LOG_LEVEL_ENV, "").strip():
        root.setLevel(logging.WARNING)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    deepspeed = logging.getLogger(DEEPSPEED_LOGGER)

    def below(record: logging.LogRecord) -> bool:  # not its level: the library that creates it would reset that
        return record.levelno >= logging.ERROR

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
    """Runs the bench with a temporary folder of its own (`TMPDIR`, for the processes it launches too; yielded), then
    removes the empty folders it made in `out` (and `out` itself, if it made it), and its temporary folder (at exit
    if a library still holds a file there: `datasets` keeps its cache files until the process ends)."""
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
