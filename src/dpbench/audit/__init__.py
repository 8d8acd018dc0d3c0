"""Empirical privacy audits: measured lower bounds on epsilon and a test of each claim."""
