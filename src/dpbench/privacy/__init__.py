"""The pieces of a private step below the mechanisms: per-sample gradients (``per_sample``),
clipping (``clipping``), and the accountants (``accounting``: PRV, RDP and the exact Gaussian,
sigma calibration, the default delta and accountant; ``pld``: privacy loss distributions, an
accountant independent of Opacus; ``profiles``: each claim's delta*(eps), which the audit tests).
Samplers, noise sources and the mechanisms that tie them to an accountant are dpbench.mechanisms."""
