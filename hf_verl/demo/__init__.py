"""The embedded demo: a tiny model learning a verifiable task with RL, offline, on a CPU."""
