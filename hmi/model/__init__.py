"""The root model and the hPLM built on it: windowed lower layers, merge, shared upper layers."""
