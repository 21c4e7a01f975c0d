"""Equivalence tests that run against a *patched* TRL (patches/*.patch applied to the trl 1.16.0 sdist).

They need TRL's native flags that only the patches add (e.g. `DPOConfig(padding_free=True)` really packing), so they
are not collected at all (not skipped) unless `TRL_EXT_PATCHED_TRL=1` is set; `patches/check.sh` sets it in the
environment it builds.
"""

import os

collect_ignore_glob = [] if os.environ.get("TRL_EXT_PATCHED_TRL") == "1" else ["*.py"]
