"""What a step costs on named hardware: cost profiles measured (our engine and vLLM), moved and read.
Importing this package imports none of its modules."""
