"""The serving environment: vLLM in its own virtual environment, driven as a process."""
