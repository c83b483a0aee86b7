"""The per-domain plan: drafter, K, largest batch size at which speculation pays, on or off.
Importing this package imports none of its modules."""
