"""The Beam pipeline wiring (no logic of its own)."""
