"""One grid cell, trained: ``train`` (data -> model -> calibration -> steps -> metrics), ``harness``
(the DP step built one way for runs and audits), ``seeds`` (a run's independent random
streams), ``cuda`` (full-precision, deterministic GPU numerics)."""
