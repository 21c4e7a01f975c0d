"""Exclusive roles that built-in plugins declare with `PluginSpec(serves=...)`; third-party plugins may use them too.

Of the plugins enabled for one trainer that serve a role, the core keeps the one of highest `precedence` (see
`trl_ext.manager.resolve_roles`). Plugins name roles, never each other.
"""

from __future__ import annotations

#: Owns the collator and the packed forward of a trainer (`trl_ext_make_collator`, `trl_ext_make_packed_forward`).
PACKING = "packing"
#: Reduces the trainer's logged metrics itself, across micro-batches and ranks, in place of TRL's per-call gathers.
METRICS = "metrics"
