"""Empirical privacy audits: a measured lower bound on epsilon and a test of each claim.

Modules, in the order an audit uses them: ``trials`` (runs the optimizer's own mechanism on
a synthetic problem with and without a canary, through the training harness), ``statistics``
(one score per trial), ``profiles`` (the claim's delta*(eps)), ``bounds`` (simultaneous
Clopper-Pearson bounds: epsilon_lower, the violation test, epsilon_gdp), ``run`` (one audit
end to end), ``summary`` (the table of audits), ``mutants`` and ``selftest`` (known-broken
mechanisms the audit must catch). ``canaries``, apart from these, measures a language model's
memorisation of inserted secrets (exposure, extraction). Importing the package imports none of them.
"""
