"""An example dpbench plugin: DP-SGD with heavy-ball momentum (``momentum``), registered
under the entry-point group ``dpbench.optimizers`` (see this package's pyproject.toml)."""
