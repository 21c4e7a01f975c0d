"""trl-ext's applications: the `trl-ext` command line, the `dpo` / `online-dpo` job launchers and the bench.

They use the library (`trl_ext`) like any user code does; the library never imports this package.
"""
