"""`python -m trl_ext ...` is `trl-ext ...` (useful under `accelerate launch -m trl_ext dpo ...`)."""

import sys

from .cli import main

sys.exit(main())
