"""Lint tooling that `make lint` loads from the repository root (not product code)."""
