"""The toolkit for plugin authors: what the built-in plugins share, public and documented, for a third-party plugin of
their kind (a packing plugin, a fused output head, an `"auto"` sizer) to use as they do. docs/writing-plugins.md lists
its modules; each module's docstring says what it holds.

The core's own names (`PluginSpec`, `hookimpl`, `UsageError`, ...) are `trl_ext.api`'s. This package imports nothing
itself; import the submodule that owns a name. `packing`'s submodules, `probe`, `online_forward` and `randomness`
import torch on use or on import, so a plugin imports them from its hooks module, never from its declaration.
"""
