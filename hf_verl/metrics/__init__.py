"""`evaluate` metrics shipped with hf_verl, loadable offline from the package itself.

`evaluate.load(metric_path("preference_accuracy"))` needs no Hub access.
"""

from __future__ import annotations

import os

_HERE = os.path.dirname(os.path.abspath(__file__))


def metric_path(name: str) -> str:
    """Local path of a bundled metric script, for `evaluate.load`."""
    path = os.path.join(_HERE, name, f"{name}.py")
    if not os.path.exists(path):
        raise ValueError(f"no bundled metric {name!r}; available: "
                         f"{sorted(d for d in os.listdir(_HERE) if os.path.isdir(os.path.join(_HERE, d)) and not d.startswith('_'))}.")
    return path
