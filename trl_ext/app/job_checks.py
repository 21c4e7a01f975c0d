"""What `trl-ext dpo` and `trl-ext online-dpo` check before a model is loaded, so that a common data or path mistake is
one `UsageError` line naming the fix instead of a traceback (or, for a model folder that does not exist, a minute of
Hub retries when offline): the output folder, the model and dataset paths or Hub ids, and the dataset's splits, rows
and columns (a `save_to_disk` folder is read with `load_from_disk`, which `load_dataset` cannot do).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from ..errors import UsageError

__all__ = ["check_dataset", "check_output_dir", "check_path", "load_job_dataset"]

#: The columns each job's trainer needs, as alternatives: `DPOTrainer` takes text or conversations (`chosen`,
#: `rejected`, the prompt explicit or inside them) or token ids (`chosen_ids`, `rejected_ids`); `OnlineDPOTrainer`
#: generates its completions from `prompt`.
NEEDED = {
    "dpo": ((("chosen", "chosen_ids"), "chosen"), (("rejected", "rejected_ids"), "rejected")),
    "online-dpo": ((("prompt",), "prompt"),),
}


def check_output_dir(path: str | os.PathLike[str]) -> None:
    """The output folder exists or can be created, and a file can be written in it."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise UsageError(
            f"`--output_dir {path}` cannot be written ({why}). Give a folder you can write to, or fix its permissions."
        ) from None


def _looks_local(value: str) -> str | None:
    """Why `value`, which does not exist, must have been meant as a local path (None: it can be a Hub id)."""
    if value.startswith((".", "/", "~")) or "\\" in value or value.endswith("/"):
        return "it is written as a path"
    if value.count("/") > 1:
        return "a Hub id has at most one `/`"
    head = value.split("/", 1)[0]
    if "/" in value and Path(head).is_dir():
        return f"`{head}/` is a folder here"
    return None


#: Seconds to wait for a connection to the Hub before calling it unreachable.
_HUB_TIMEOUT_S = 5.0


def _hub_unreachable() -> str | None:
    """Why the Hub cannot be reached from here (`HF_HUB_OFFLINE`, or no connection to its endpoint within a few
    seconds), or None. Behind a proxy the Hub is left to answer for itself: a direct connection says nothing there."""
    if any(
        os.environ.get(v, "").lower() in ("1", "true", "yes", "on") for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    ):
        return "HF_HUB_OFFLINE is set"
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    import socket
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    url = urlsplit(constants.ENDPOINT)
    host = url.hostname or "huggingface.co"
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=_HUB_TIMEOUT_S).close()
    except OSError as exc:
        # Without this check the Hub client retries for about 40 s, then raises `OSError`.
        return f"{host} cannot be reached from here: {exc.strerror or exc}"
    return None


def check_path(value: str | None, flag: str, kind: str, repo_type: str = "model") -> None:
    """A model (`kind` "model") or dataset given as `flag value` exists: a local path that does not exist is refused
    at once, and so is a file where a model folder is needed; a Hub model id that is not in the local cache needs
    the Hub (offline, or with no connection to it, that is said at once)."""
    path = os.path.expanduser(value) if value else None
    if path is not None and repo_type == "model" and os.path.isfile(path):
        raise UsageError(
            f"`{flag} {value}` is a file; a {kind} is a folder (with its `config.json` and weights, as "
            "`save_pretrained` writes it) or a Hub id. Give the folder."
        )
    if not value or os.path.exists(path or value):
        return
    why = _looks_local(value)
    if why is not None:
        raise UsageError(
            f"`{flag} {value}`: the folder {os.path.abspath(os.path.expanduser(value))} does not exist ({why}, so it "
            f"is not read as a Hub id). Give the folder of a saved {kind}, or a Hub id."
        )
    if repo_type == "model":
        from huggingface_hub import try_to_load_from_cache

        if isinstance(try_to_load_from_cache(value, "config.json"), str):
            return
        unreachable = _hub_unreachable()
        if unreachable is not None:
            raise UsageError(
                f"`{flag} {value}`: no such folder, the Hub model `{value}` is not in the local cache, and the Hub "
                f"cannot be used ({unreachable}). Give the folder of a saved {kind}, or download it first (online)."
            )


def load_job_dataset(name: str, config: str | None, train_split: str, streaming: bool = False) -> Any:
    """`--dataset_name` as a `DatasetDict`: a `save_to_disk` folder through `load_from_disk` (a single saved `Dataset`
    becomes the `train_split` split), anything else through `load_dataset`."""
    import datasets

    folder = Path(os.path.expanduser(name))
    if (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file():  # a `save_to_disk` folder
        try:
            loaded = datasets.load_from_disk(os.path.expanduser(name))
        except Exception as exc:  # noqa: BLE001 - datasets raises IndexError for a folder saved with no rows
            raise UsageError(
                f"`--dataset_name {name}` is a `save_to_disk` folder that `load_from_disk` cannot read "
                f"({type(exc).__name__}: {exc}); a dataset saved with no rows reads so. Save it again with data."
            ) from None
        if isinstance(loaded, datasets.Dataset):
            loaded = datasets.DatasetDict({train_split: loaded})
        if streaming:
            loaded = datasets.IterableDatasetDict({k: v.to_iterable_dataset() for k, v in loaded.items()})
        return loaded
    check_path(name, "--dataset_name", "dataset", repo_type="dataset")
    try:
        return datasets.load_dataset(name, name=config, streaming=streaming)
    except StopIteration:
        # datasets infers the features from a first row, and an empty data file has none.
        found = folder.rglob("*") if folder.is_dir() else ()
        empty = sorted(str(p.relative_to(folder)) for p in found if p.is_file() and p.stat().st_size == 0)
        files = f" ({', '.join(empty)} {'is' if len(empty) == 1 else 'are'} empty)" if empty else ""
        raise UsageError(
            f"The dataset `{name}` has no rows{files}: `datasets` cannot read a split without one. Give a dataset "
            "with data."
        ) from None


def check_dataset(dataset: Any, command: str, name: str, train_split: str, test_split: str | None) -> None:
    """The split(s) the job reads exist, the training split has rows and the columns the trainer needs."""
    splits = list(dataset.keys()) if hasattr(dataset, "keys") else []
    for split, flag in ((train_split, "--dataset_train_split"), (test_split, "--dataset_test_split")):
        if split is not None and split not in splits:
            raise UsageError(
                f"The dataset `{name}` has no split `{split}` (its splits: {', '.join(splits) or 'none'}). Set "
                f"`{flag}` to one of them."
            )
    train = dataset[train_split]
    rows = getattr(train, "num_rows", None)
    if rows == 0:
        raise UsageError(f"The dataset `{name}` has no rows in its `{train_split}` split. Give a dataset with data.")
    columns = list(getattr(train, "column_names", None) or [])
    if not columns:  # a streamed dataset may not know its columns before its first row
        return
    for alternatives, what in NEEDED[command]:
        if not any(column in columns for column in alternatives):
            needed = ", ".join(f"`{w}`" for _, w in NEEDED[command])
            raise UsageError(
                f"The dataset `{name}` (split `{train_split}`) has no `{what}` column (its columns: "
                f"{', '.join(columns)}). `trl-ext {command}` needs {needed}: rename the column "
                f"(`dataset.rename_column(...)`) or give another dataset."
            )
