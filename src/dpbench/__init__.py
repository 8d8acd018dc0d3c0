"""dpbench: a reproducible benchmark of differentially private optimizers."""

__version__ = "0.1.0"
