"""The checks of a planned config: live confirmation, losslessness, the engine check and the sampling
test on vLLM, the load check. Importing this package imports none of its modules."""
