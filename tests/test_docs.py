"""The docs hold together: every relative link in README.md and docs/*.md reaches a file (and, with a `#fragment`,
a heading of it); every repository path they name (`hf_verl/...`, `examples/...`, `benchmarks/...`, `configs/...`,
`tests/...`, `scripts/...`, `docs/...`, in backticks or in code blocks) exists; README.md's docs list links every
page of docs/ and its examples list names every examples/*.py.

The checks read the folders, so a new page or example fails here until README.md lists it.
"""

import itertools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^(```|~~~)")
LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
# a repository path: one of the top-level folders, not glued to a longer word or path before it
REPO_PATH = re.compile(r"(?<![\w./~-])((?:hf_verl|examples|benchmarks|configs|tests|scripts|docs)/[\w./*<>|{}-]*)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _split(text: str) -> tuple[list[str], list[str]]:
    """(prose lines, lines inside fenced code blocks)."""
    prose, code, fenced = [], [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        (code if fenced else prose).append(line)
    return prose, code


def links(text: str) -> list[str]:
    """The targets of the markdown links of `text` (outside code spans and code blocks)."""
    prose, _ = _split(text)
    out = []
    for line in prose:
        out += LINK.findall(CODE_SPAN.sub("", line))
    return out


def named_paths(text: str) -> list[str]:
    """Repository paths `text` names: inside code spans and fenced code blocks (commands, file names)."""
    prose, code = _split(text)
    spans = [m.group(2) for line in prose for m in CODE_SPAN.finditer(line)]
    found = []
    for chunk, in_block in [(s, False) for s in spans] + [(c, True) for c in code]:
        for path in REPO_PATH.findall(chunk):
            path = path.split("::")[0].rstrip(".,:;)")
            # in a code block (commands, printed output) only a file name or a folder with its slash counts:
            # a label such as `ratio hf_verl/trl` is not a path
            if in_block and not (path.endswith("/") or "." in path.rsplit("/", 1)[-1]):
                continue
            found.append(path)
    return found


def expand(path: str) -> list[str]:
    """Glob patterns for a named path: `<a|b>` alternatives are expanded, other `<...>` placeholders and `{...}`
    become `*`."""
    parts = re.split(r"(<[^<>]*\|[^<>]*>)", path)
    choices = [p[1:-1].split("|") if p.startswith("<") and "|" in p else [p] for p in parts]
    out = []
    for combo in itertools.product(*choices):
        out.append(re.sub(r"<[^<>]*>|\{[^{}]*\}", "*", "".join(combo)))
    return out


def exists(path: str) -> bool:
    return all(any(ROOT.glob(p.rstrip("/"))) if "*" in p else (ROOT / p).exists() for p in expand(path))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor in `page` (repeats get GitHub's -1, -2 suffixes)."""
    prose, _ = _split(page.read_text())
    seen: dict[str, int] = {}
    out = set()
    for line in prose:
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def section(text: str, title: str) -> str:
    """The body of the `## <title>` section of a page (up to the next heading of level 2 or above)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == f"## {title}"), None)
    assert start is not None, f"README.md has no '## {title}' section"
    body = []
    for line in lines[start + 1:]:
        if re.match(r"^#{1,2}\s", line):
            break
        body.append(line)
    return "\n".join(body)


# Known breakage in pages this check's author does not own, to be fixed by their owner; strict, so that the entry
# must go once the page is fixed.
KNOWN_BROKEN_LINKS: dict[str, str] = {}  # page -> why its broken link is known (an xfail that flags its own fix)


def _with_known(pages, known):
    return [pytest.param(p, marks=pytest.mark.xfail(strict=True, reason=known[rel]))
            if (rel := p.relative_to(ROOT).as_posix()) in known else p for p in pages]


@pytest.mark.parametrize("page", _with_known(PAGES, KNOWN_BROKEN_LINKS), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest})")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target} (no heading with anchor #{fragment} in {dest.relative_to(ROOT)})")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_named_repository_path_exists(page):
    missing = sorted({p for p in named_paths(page.read_text()) if not exists(p)})
    assert not missing, f"{page.relative_to(ROOT)} names files that are not in the repository: {missing}"


def test_readme_docs_list_links_every_page():
    listed = {Path(t.partition("#")[0]).name for t in links(section(README.read_text(), "Documentation"))
              if t.startswith("docs/")}
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert not pages - listed, f"docs pages missing from README.md's '## Documentation' list: {sorted(pages - listed)}"


def test_readme_examples_list_names_every_example():
    body = section(README.read_text(), "Examples")
    examples = sorted(p.name for p in (ROOT / "examples").glob("*.py"))
    missing = [name for name in examples if f"examples/{name}" not in body]
    assert examples and not missing, f"examples missing from README.md's '## Examples' list: {missing}"


# ------------------------------------------------------------------ the checks' own parsing, on known text
def test_parsers_find_links_paths_and_anchors(tmp_path):
    text = ("See [the guide](docs/parallel.md#limits) and [site](https://x.org) and `hf_verl/cli.py`.\n"
            "Not a link: `[a](b.md)`; a glob `configs/accelerate/*_cpu.yaml`, a choice "
            "`configs/accelerate/<ddp|zero9>.yaml`, a test `tests/test_docs.py::test_x`.\n"
            "```bash\npython benchmarks/nope.py --x  # [c](d.md)\nratio hf_verl/trl: x1.25\n```\n"
            "A folder `my_tests/foo.py` is not a repository path, nor is `hf_verl_demo/latest`.\n")
    assert links(text) == ["docs/parallel.md#limits", "https://x.org"]
    assert named_paths(text) == ["hf_verl/cli.py", "configs/accelerate/*_cpu.yaml",
                                 "configs/accelerate/<ddp|zero9>.yaml", "tests/test_docs.py", "benchmarks/nope.py"]
    assert exists("configs/accelerate/*_cpu.yaml") and exists("configs/accelerate/<ddp|zero2>.yaml")
    assert not exists("configs/accelerate/<ddp|zero9>.yaml") and not exists("benchmarks/nope.py")
    assert slug("The demo's DPO recipe, measured") == "the-demos-dpo-recipe-measured"
    assert slug("Sequence parallelism from `parallelism_config`") == "sequence-parallelism-from-parallelism_config"
    page = tmp_path / "p.md"
    page.write_text("# A\n## Limits\n```\n# not a heading\n```\n## Limits\n")
    assert anchors(page) == {"a", "limits", "limits-1"}
