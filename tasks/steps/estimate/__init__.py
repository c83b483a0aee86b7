"""Acceptance offline: each domain's estimate from the run's sample, and the acceptance figures every
check compares. Importing this package imports none of its modules."""
