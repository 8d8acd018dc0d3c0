"""One grid cell, trained: ``train`` (data -> model -> calibration -> steps -> metrics), and its
stages: ``config`` (RunConfig, every setting of a run, each declared as ``settings`` says),
``splits`` (the data), ``calibration`` (the plan request and sigma), ``checkpoint`` (the trace
and resuming a killed run); ``harness`` (the DP step built one way for runs and audits),
``cuda`` (the run's torch device; full-precision, deterministic GPU numerics), ``capture``
(steps on padded batches replayed as CUDA graphs). A run's random streams are
``dpbench.seeds``, on the ground floor: the matrix mechanisms' noise files are keyed by them
too."""
