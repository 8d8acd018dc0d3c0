"""What the Snakemake workflow asks of the package: ``grid`` (a config expanded into training
cells, validated), ``cluster`` (what a job asks a cluster for), ``fingerprint`` (the code behind
a result, for incremental reruns), ``watch`` (jobs that die with their workflow)."""
