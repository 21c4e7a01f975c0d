"""Exclusive roles that plugins declare with `PluginSpec(serves=...)`: of those enabled for one trainer that serve a
role, the core keeps the one of highest `precedence` (`trl_ext.manager.resolve_roles`; docs/writing-plugins.md)."""

from __future__ import annotations

#: Owns the collator and the packed forward of a trainer (`trl_ext_make_collator`, `trl_ext_make_packed_forward`).
PACKING = "packing"
#: Reduces the trainer's logged metrics itself, across micro-batches and ranks, in place of TRL's per-call gathers.
METRICS = "metrics"
