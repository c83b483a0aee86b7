"""The evaluation run's steps and what only they use (docs/design.md: the layout of tasks/).
Importing this package imports none of its modules: each step's cost is paid by its callers."""
