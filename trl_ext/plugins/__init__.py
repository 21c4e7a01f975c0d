"""trl-ext's built-in plugins.

Each is a module registered exactly like a third-party plugin (same `PluginManager.register` call, under its name);
the module docstring is its user documentation. `BUILTIN_PLUGINS` maps each plugin name to its module.

A plugin module may declare, besides its hook implementations:

- `TRL_EXT_FLAGS`: the `TrlExtConfig` flags it owns. Setting any of them (to a non-default value) enables the plugin.
- `TRL_EXT_TRAINERS`: the trainer class names it applies to (all, if absent).
"""

from __future__ import annotations

#: name -> module, in registration order. Names are the same everywhere: module, flag, entry point, log lines.
BUILTIN_PLUGINS: dict[str, str] = {
    "padding_free": "trl_ext.plugins.padding_free",
    "precompute_ref_batch_size": "trl_ext.plugins.precompute_ref_batch_size",
    "generation": "trl_ext.plugins.generation",
    "sync_metrics": "trl_ext.plugins.sync_metrics",
}
