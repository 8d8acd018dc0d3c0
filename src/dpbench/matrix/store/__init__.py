"""The one store of the matrix mechanisms' files: what names a file (``keys``: dense and
streamed factorization keys), where it lives and how concurrent runs make it once (``cache``:
the cache layout, paths, locks), and what each file holds and what loading it verifies
(``dense_files``: a dense factorization's .npz; ``streamed_files``: a streamed factorization's
JSON; ``noise_files``: C^-1 Z, one .npy per (factorization, d, seed)). The mathematics the files
hold is dpbench.matrix's other modules, which hold no path, lock or file format."""
