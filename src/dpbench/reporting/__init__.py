"""From runs to what people read: ``results`` (the one writer and reader of run files and
tables), ``aggregate`` (many run files -> the runs and epochs tables), ``audits`` (the files
``dpbench audit`` writes -> the audits table), ``figures`` (the figures as pure functions of
those tables, built-in and plugins', and the registry of them)."""
