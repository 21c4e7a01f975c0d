"""trl-ext's built-in plugins.

Every public module or subpackage here is a plugin. It declares itself with `TRL_EXT_PLUGIN = trl_ext.PluginSpec(...)`
(flags, options, trainers, the TRL flag it serves) next to its hook implementations, and is registered exactly like
a third-party plugin (`trl_ext.manager`), under its module name. Its module docstring is a summary (`trl-ext plugins
NAME` prints it) pointing at docs/plugins/NAME.md, its user documentation.
Nothing outside a plugin's own module names it: adding a plugin is adding a module.
"""
