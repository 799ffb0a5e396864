"""Bridges from attncc kernels to model libraries (optional dependencies, imported on use)."""
