"""Reward sources behind one interface: callables, Hub reward models, rule scorers."""
