"""Parallel layouts and distributed helpers."""
