"""Empirical privacy audits: a measured lower bound on epsilon and a test of each claim.

Modules, in the order an audit uses them: ``trials`` (runs the optimizer's own mechanism on
a synthetic problem with and without a canary, through the training harness), ``statistics``
(one score per trial), ``bounds`` (simultaneous Clopper-Pearson bounds: epsilon_lower, the
violation test against the claim's delta*(eps), epsilon_gdp), ``run`` (one audit end to end),
``mutants`` and ``selftest`` (known-broken mechanisms the audit must catch).

The audit is the top layer below the command line, and nothing else imports it: the claims
it tests are the accountants' (``dpbench.privacy.profiles``), the table of audit files is
``dpbench.reporting.audits``, and a language model's canaries are ``dpbench.problems.canaries``.
Importing the package imports none of its modules.
"""
