"""An example dpbench plugin: DP-SGD with heavy-ball momentum (``momentum``, the entry-point group
``dpbench.optimizers``), scikit-learn's handwritten digits (``digits``, ``dpbench.problems``) and
a table of the runs' privacy (``figures``, ``dpbench.figures``); see this package's pyproject.toml."""
