"""Matrix-factorization mechanisms (thesis 2.2.5): the prefix-sum workload A = B C, its
single-epoch (fixed point) and multi-epoch (dual) factorizations, their sensitivity, the
correlated noise C^-1 Z on disk, fixed-batch participation, and the Mechanism that the
``dpmatrix-*`` optimizers use. Symbols: workload A, strategy C, noising matrix C^-1,
decoder B = A C^-1, Gram matrix X = C^T C; see docs/matrix.md."""
