"""The datasets, read from their official files and verified against checksums; never replaced
by synthetic data. ``image_datasets``: Fashion-MNIST and CIFAR-10; ``fortunes``: the text corpus
of P4 (Debian's fortunes). No torch here: the workflow's data rule runs without it."""
