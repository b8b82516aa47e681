"""Slow, obviously-right references and Hypothesis strategies for tests (no Numba in the references)."""
