"""The datasets, read from their official files and verified against checksums; never replaced
by synthetic data. ``dataset``: what every loader shares (``Dataset``, ``DataError``);
``image_datasets``: Fashion-MNIST and CIFAR-10; ``debian``: a corpus of a Debian package's files,
located and verified; ``fortunes``: the text corpus of P4 (Debian's fortunes); ``wordnet``: the
public corpus of pretraining (WordNet 3.0's glosses, Debian's wordnet-base); ``overlap``:
removing the private text from a public corpus. No torch here: the workflow's data rule runs
without it."""
