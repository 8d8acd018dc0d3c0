"""The mathematics of matrix factorization (thesis 2.2.5): the prefix-sum workload A = B C, its
single-epoch (fixed point) and multi-epoch (dual) factorizations, banded Toeplitz and BLT
strategies, their sensitivity; and ``store``, where factorizations and noise files live on disk
and what they hold. The mechanisms built on them (dense, streamed, amplified) are
dpbench.mechanisms. Symbols: workload A, strategy C, noising matrix C^-1, decoder B = A C^-1,
Gram matrix X = C^T C; see docs/matrix.md."""
