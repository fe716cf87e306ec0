"""The tools: run each with `python -m tools.NAME` from the repository root."""
