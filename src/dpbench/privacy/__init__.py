"""What makes a step private, piece by piece: per-sample gradients (``per_sample``), clipping
(``clipping``), i.i.d. Gaussian noise (``noise``), Poisson batches (``sampling``), the mechanisms
that tie a sampler, a noise source and an accountant together (``mechanisms``), and the
accountants themselves (``accounting``: PRV and RDP; ``pld``: privacy loss distributions).
Correlated noise (matrix factorizations) lives in ``dpbench.matrix``."""
