"""Pipeline steps of specdec-rollout: plain functions with explicit inputs and JSON-able results."""
