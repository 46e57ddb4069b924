"""Reward sources behind one interface: callables, Hub reward models, reward models behind a URL (`remote`),
rule scorers."""
