"""The layers hold: docs/architecture.md's table names every top-level module and package of hf_verl and what each
may import; every import in the package (at module level or inside a function) follows it. A new module fails here
until the table lists it, and an arrow the table does not allow fails naming the file and the line."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hf_verl"
TABLE_HEADING = "## Layers"
CODE = re.compile(r"`([^`]+)`")


def table() -> dict[str, set[str]]:
    """unit -> the units it may import, from the first table under the "Layers" heading."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text[text.index(TABLE_HEADING):]
    rules: dict[str, set[str]] = {}
    for line in section.splitlines()[1:]:
        if line.startswith("## "):
            break
        if not line.startswith("|") or set(line) <= {"|", "-", " "}:
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or cells[0] == "layer":
            continue
        allowed = {name for name in CODE.findall(cells[2])}
        for unit in CODE.findall(cells[0]):
            rules[unit] = allowed
    return rules


def units() -> set[str]:
    """The top-level modules (`cli.py`) and packages (`engine/`) of hf_verl."""
    out = {p.name for p in PACKAGE.glob("*.py")}
    out |= {p.name + "/" for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    return out


def unit_of(module: str) -> str | None:
    """The top-level unit a dotted `hf_verl...` module name falls in (None for `hf_verl` itself)."""
    parts = module.split(".")
    if parts[0] != "hf_verl" or len(parts) == 1:
        return None
    return parts[1] + "/" if (PACKAGE / parts[1]).is_dir() else parts[1] + ".py"


def imports() -> list[tuple[str, str, str]]:
    """(importing unit, imported unit, "file:line") of every hf_verl import inside the package."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        src = rel.parts[0] + "/" if len(rel.parts) > 1 else rel.parts[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] if node.module != "hf_verl" else [f"hf_verl.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                dst = unit_of(name)
                if dst is not None and dst != src and (PACKAGE / dst).exists():
                    found.append((src, dst, f"{path.relative_to(ROOT)}:{node.lineno}"))
    return found


def test_the_table_lists_every_module_and_nothing_else():
    rules = table()
    assert set(rules) == units(), {"not in the table": sorted(units() - set(rules)),
                                   "not in hf_verl": sorted(set(rules) - units())}
    for unit, allowed in rules.items():
        assert allowed <= units(), (unit, sorted(allowed - units()))


def test_every_import_follows_the_table():
    rules = table()
    wrong = [f"{where}: {src} imports {dst}" for src, dst, where in imports() if dst not in rules.get(src, set())]
    assert not wrong, "imports the table (docs/architecture.md, Layers) does not allow:\n" + "\n".join(wrong)


def test_the_checker_sees_function_level_imports():
    """The scan is not blind: the facade imports the planner inside a method, and that arrow is found."""
    edges = {(src, dst) for src, dst, _ in imports()}
    assert ("facade/", "planner/") in edges and ("trainers/", "pipeline/") in edges
    assert unit_of("hf_verl.engine.registry") == "engine/" and unit_of("hf_verl.settings") == "settings.py"


def test_no_layer_imports_upward():
    """The table is a layering: its arrows form no cycle (a unit never reaches itself)."""
    rules = table()
    for start in rules:
        seen, todo = set(), list(rules[start])
        while todo:
            unit = todo.pop()
            assert unit != start, f"{start} reaches itself through the table's arrows"
            if unit not in seen:
                seen.add(unit)
                todo.extend(rules.get(unit, ()))


def test_the_private_trainer_methods_overridden_are_the_ones_the_page_lists():
    """docs/architecture.md lists every private `transformers.Trainer` method the trainers override, with why."""
    import transformers

    from hf_verl import DPOTrainer, GRPOTrainer, PPOTrainer

    overridden = set()
    for cls in (GRPOTrainer, PPOTrainer, DPOTrainer):
        for klass in cls.__mro__:
            if klass.__module__.startswith("hf_verl"):
                overridden |= {n for n in vars(klass) if n.startswith("_") and not n.startswith("__")
                               and hasattr(transformers.Trainer, n)}
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text[text.index("Private Trainer methods still overridden"):]
    rows = [line for line in section.splitlines()[1:40] if line.startswith("| `")]
    listed = {name for row in rows for name in CODE.findall(row.split("|")[1]) if name.startswith("_")}
    assert overridden == listed, {"overridden, not listed": sorted(overridden - listed),
                                  "listed, not overridden": sorted(listed - overridden)}
