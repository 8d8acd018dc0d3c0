"""Empirical privacy audit: test statistics, simultaneous confidence bounds and claimed privacy profiles."""
