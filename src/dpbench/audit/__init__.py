"""Empirical privacy audits: a measured lower bound on epsilon and a test of each claim.

Modules, in the order an audit uses them: ``trials`` (runs the optimizer's own mechanism on
a synthetic problem with and without a canary, through the training harness), ``statistics``
(one score per trial), ``bounds`` (simultaneous Clopper-Pearson bounds: epsilon_lower, the
violation test against the claim's delta*(eps), which each mechanism states through
``dpbench.privacy.profiles``, epsilon_gdp), ``run`` (one audit end to end), ``summary`` (the
table of audits), ``mutants`` and ``selftest`` (known-broken mechanisms the audit must catch).
The audit is the package's top layer below the command line: nothing else imports it (a
language model's canaries are ``dpbench.problems.canaries``). Importing the package imports
none of them.
"""
