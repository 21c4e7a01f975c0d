"""`python -m trl_ext ...` is `trl-ext ...` (useful under `accelerate launch -m trl_ext dpo ...`)."""

import sys

from .app.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
