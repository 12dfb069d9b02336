"""Regression statistics over the results store: verdicts with bootstrap confidence intervals, step detection,
and the history/export commands that read the store."""
