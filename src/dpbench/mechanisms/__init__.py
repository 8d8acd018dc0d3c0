"""The mechanism layer: what makes a run's releases private, one module per mechanism idea.
``base`` (the interface, the request a run plans with, the plan every mechanism fixes, how the
audit attacks it); ``sampling`` (Poisson, fixed batches, cyclic Poisson); ``noise`` (i.i.d.,
from a noise file, streamed); the mechanisms ``poisson_gaussian`` (DP-SGD's), ``unamplified``,
``projection`` (D2P2's random projections), ``dense_matrix``, ``streamed`` (BandMF, BLT) and
``amplified_banded``, with ``cyclic_poisson`` (amplified BandMF's accounting and band search).
The accountants they use are dpbench.privacy's; the matrix mathematics is dpbench.matrix's."""
