"""Bundled `evaluate` metric: preference accuracy."""
