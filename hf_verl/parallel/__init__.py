"""Parallel layouts and distributed helpers; the layout planner (`estimate_memory`, `plan`) resolves lazily."""

__all__ = ["estimate_memory", "plan"]


def __getattr__(name: str):
    if name == "estimate_memory":
        from hf_verl.parallel.planner.estimate import estimate_memory

        return estimate_memory
    if name == "plan":
        from hf_verl.parallel.planner.plan import plan

        return plan
    raise AttributeError(f"module 'hf_verl.parallel' has no attribute {name!r}")
