"""The toolkit for plugin authors: what the built-in plugins share, public and documented, for a third-party plugin of
their kind (a packing plugin, a fused output head, an `"auto"` sizer) to use as they do.

- `packing`: packed ("padding-free") forward passes: the packed layout (`packing.metadata`), the varlen attention and
  its registration with transformers (`packing.attention`), the fused varlen kernels and their choice and probe
  (`packing.kernels`, `packing.probe`, `packing.segments`), the glue around the model (`packing.glue`: collator,
  scoring call, re-padded outputs), and the packed positions announced around a packed call (`packing.positions`).
- `architecture`: what a causal LM's layers do to a packed row (`inspect_model`, `VERIFIED_MODEL_TYPES`,
  `verified_except`): whether packing it is exact.
- `probe`: the self-checks' probe, sized from what training will feed, and the stock padded forward to compare with.
- `online_forward`: Online DPO's scoring forward written once (`ScoringCall`), verified against TRL's own `_forward`
  (`verify_against_trl`).
- `randomness`: the random numbers a model draws in training mode, found by the generator they advance.
- `memory`: the extra memory a piece of work needs, the budget it may use (`ExtraMemory`, `budget_bytes`,
  `over_budget`), for sizing work by probing it.
- `roles`: the exclusive roles plugins serve (`PACKING`, `METRICS`).

The core's own names (`PluginSpec`, `hookimpl`, `UsageError`, ...) are `trl_ext.api`'s. This package imports nothing
itself; import the submodule that owns a name. `packing`'s submodules, `probe`, `online_forward` and `randomness`
import torch on use or on import, so a plugin imports them from its hooks module, never from its declaration.
"""
