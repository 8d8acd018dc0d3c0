"""What the Snakemake workflow asks of the package: ``grid`` (a config expanded into training
cells, validated against ``config.schema.yaml``), ``jobs`` (every job of a config: cells,
audits, figures and the files they write), ``cluster`` (what a job asks a cluster for), ``fingerprint`` (the code behind
a result, for incremental reruns), ``watch`` (jobs that die with their workflow)."""
