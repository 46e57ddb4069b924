"""Run TRL's own GRPO / DPO / RLOO / reward-model / GKD test files against TRL and against hf_verl, with only the
import line changed.

    .venv/bin/python tests/trl_suite/run.py --suite dpo|grpo|rloo|reward|gkd [-k EXPR] [--target both|trl|hf_verl]

Steps: (1) take `tests/test_<suite>_trainer.py` (GKD: `tests/experimental/test_gkd_trainer.py`), `testing_utils.py`,
`testing_constants.py`, `conftest.py` (and `tests/data/`) from a TRL source (a git directory or a checkout:
`--trl-src`, default `$TRL_SRC` or the fetched mirror; ref `v<installed trl version>` when that tag exists, else
`HEAD`); (2) build the offline Hub of tiny models and data sets those files load (:mod:`hub_fixtures`, cached by
content); (3) copy the files into two temporary trees, one untouched and one where `from trl import <Suite>Config,
<Suite>Trainer` (GKD: `from trl.experimental.gkd import ...`) becomes `from hf_verl import ...` (every other trl
import stays); (4) run pytest in each, offline, with TRL's CPU CI
selection (`-m "not slow and not low_priority"`; GPU / vLLM-server / liger / kernels tests skip through TRL's
own markers), a per-test timeout, JUnit XML; (5) write `results.json` (per-test outcome on each side) and
`summary.md` (tests passing on TRL; of those, passing on hf_verl; each hf_verl failure with its first error line).

`--target hf_verl` reuses the TRL side stored by an earlier run in the same `--out` (TRL's results do not
change while hf_verl is being fixed); a run with `-k` updates the stored results of the tests it ran. Not part of hf_verl's own test set: nothing here is named `test_*`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))

from hub_fixtures import build_hub, offline_env, processor_prelude  # noqa: E402

DEFAULT_TRL_SRC = "/work/.mirror/huggingface+trl/repo"
SUPPORT_FILES = ["__init__.py", "conftest.py", "testing_utils.py", "testing_constants.py"]
HF_VERL_NAMES = {"GRPOConfig", "GRPOTrainer", "DPOConfig", "DPOTrainer", "RLOOConfig", "RLOOTrainer", "RewardConfig",
                 "RewardTrainer", "GKDConfig", "GKDTrainer"}
SUITES = ("dpo", "grpo", "rloo", "reward", "gkd")
# a suite's test file in TRL's tree, where it is not tests/test_<suite>_trainer.py
SUITE_FILES = {"gkd": "tests/experimental/test_gkd_trainer.py"}


def suite_file(suite: str) -> str:
    """The suite's test file, relative to TRL's root (and to the laid-out tree's)."""
    return SUITE_FILES.get(suite, f"tests/test_{suite}_trainer.py")
PYTEST_INI = """[pytest]
markers =
    slow: slow
    low_priority: low priority
    invariant: training-invariant checks
"""
# an error line saying a Hub repository is not in the offline hub (a fixture this harness does not build)
MISSING_FIXTURE = re.compile(r"couldn't connect to 'https://huggingface\.co'|Couldn't reach '[^']*' on the Hub|"
                             r"OfflineModeIsEnabled|LocalEntryNotFoundError|Couldn't find cache for", re.IGNORECASE)


# ----------------------------------------------------------------------------------------------- TRL sources
class TrlSource:
    """TRL's test files from a git directory (at a ref) or from a checked-out tree."""

    def __init__(self, path: str, ref: str | None):
        self.path = Path(path)
        self.is_git = (self.path / "HEAD").exists() and (self.path / "objects").exists()
        if self.is_git:
            self.ref = ref or self._default_ref()
            self.commit = self._git("rev-parse", f"{self.ref}^{{commit}}").strip()
        else:
            if not (self.path / "tests").is_dir():
                raise SystemExit(f"--trl-src {path}: neither a git directory nor a TRL checkout (no tests/).")
            self.ref, self.commit = "working tree", None
        self.version = self.read("VERSION").strip() if self.exists("VERSION") else "unknown"

    def _git(self, *args: str) -> str:
        return subprocess.run(["git", "--git-dir", str(self.path), *args], check=True, capture_output=True,
                              text=True).stdout

    def _default_ref(self) -> str:
        import importlib.metadata

        tag = f"v{importlib.metadata.version('trl')}"
        tags = self._git("tag", "--list", tag).split()
        return tag if tag in tags else "HEAD"

    def exists(self, rel: str) -> bool:
        if self.is_git:
            return subprocess.run(["git", "--git-dir", str(self.path), "cat-file", "-e", f"{self.ref}:{rel}"],
                                  capture_output=True).returncode == 0
        return (self.path / rel).exists()

    def read(self, rel: str) -> str:
        return self._git("show", f"{self.ref}:{rel}") if self.is_git else (self.path / rel).read_text()

    def list_dir(self, rel: str) -> list[str]:
        if self.is_git:
            out = self._git("ls-tree", "-r", "--name-only", self.ref, rel + "/")
            return [line for line in out.splitlines() if line]
        root = self.path / rel
        return [str(p.relative_to(self.path)) for p in root.rglob("*") if p.is_file()] if root.is_dir() else []


def rewrite_imports(source: str) -> tuple[str, list[str]]:
    """Point `from trl import <hf_verl's trainer / config names>` at hf_verl; keep every other trl import.

    Returns the new source and the changed lines (for the record)."""
    changed = []
    pattern = re.compile(r"^from trl(?:\.experimental\.gkd)? import (\(?)([^()\n]*(?:\n[^()]*)*?)(\)?)$",
                         re.MULTILINE)

    def replace(match: re.Match) -> str:
        names = [n.strip() for n in match.group(2).replace("\n", ",").split(",") if n.strip()]
        ours = [n for n in names if n.split(" as ")[0] in HF_VERL_NAMES]
        if not ours:
            return match.group(0)
        rest = [n for n in names if n not in ours]
        lines = [f"from hf_verl import {', '.join(ours)}"]
        if rest:
            lines.append(f"{match.group(0).split(' import ')[0]} import {', '.join(rest)}")
        changed.append(f"{match.group(0)!r} -> {' / '.join(lines)!r}")
        return "\n".join(lines)

    return pattern.sub(replace, source), changed


def availability_shims(support_sources: list[str]) -> str:
    """Conftest prelude defining the `is_<package>_available` helpers that TRL's support files import from
    `trl.import_utils` when the installed trl lacks them (the test files may come from another TRL version than the
    installed one); each answers whether the package imports. Applied to both sides alike."""
    wanted = set()
    for text in support_sources:
        for block in re.findall(r"from trl\.import_utils import \(?([^)]*?)\)?\n(?!\s)", text, re.DOTALL):
            wanted.update(n.strip() for n in block.replace("\n", ",").split(",") if n.strip())
    helpers = sorted(n for n in wanted if re.fullmatch(r"is_\w+_available", n))
    if not helpers:
        return ""
    lines = ["# trl_suite: helpers the TRL test support files import that the installed trl may lack (version skew)",
             "import importlib as _trl_suite_importlib", "import importlib.util as _trl_suite_util", "",
             "_trl_suite_iu = _trl_suite_importlib.import_module('trl.import_utils')"]
    for name in helpers:
        package = name[len("is_"): -len("_available")]
        lines.append(f"if not hasattr(_trl_suite_iu, {name!r}):\n    _trl_suite_iu.{name} = "
                     f"lambda *a, **k: _trl_suite_util.find_spec({package!r}) is not None")
    return "\n".join(lines) + "\n\n"


def lay_out(src: TrlSource, suite: str, target: str, root: Path) -> list[str]:
    """Write the test tree for one target under `root`; returns the rewritten import lines."""
    tests = root / "tests"
    tests.mkdir(parents=True)
    support = {name: src.read(f"tests/{name}") if src.exists(f"tests/{name}") else "" for name in SUPPORT_FILES}
    support["conftest.py"] = (availability_shims(list(support.values())) + processor_prelude()
                              + support["conftest.py"])
    for name, text in support.items():
        (tests / name).write_text(text)
    for rel in src.list_dir("tests/data"):
        out = root / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(src.read(rel))
    text = src.read(suite_file(suite))
    changed: list[str] = []
    if target == "hf_verl":
        text, changed = rewrite_imports(text)
        if not changed:
            raise SystemExit(f"no `from trl import ...{suite.upper()}Trainer` line found to rewrite")
    test_path = root / suite_file(suite)
    test_path.parent.mkdir(parents=True, exist_ok=True)
    if test_path.parent != tests:  # a subpackage (tests/experimental): its relative imports need the package
        (test_path.parent / "__init__.py").write_text("")
    test_path.write_text(text)
    (root / "pytest.ini").write_text(PYTEST_INI)
    return changed


# ----------------------------------------------------------------------------------------------- running
def run_pytest(root: Path, suite: str, hf_home: Path, xml: Path, log: Path, keyword: str | None,
               timeout: int, extra: list[str], hf_verl_src: Path) -> int:
    env = dict(os.environ, **offline_env(hf_home))
    env["PYTHONPATH"] = os.pathsep.join([str(hf_verl_src), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["HF_VERL_CACHE"] = str(root / "hf_verl_cache")  # precomputed reference log-probs: never shared between runs
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("OMP_NUM_THREADS", "1")  # tiny models: threads only contend on a shared 2-core machine
    env.pop("PYTEST_ADDOPTS", None)
    cmd = [sys.executable, "-m", "pytest", suite_file(suite), "-p", "no:cacheprovider",
           "-m", "not slow and not low_priority", "-q", "-rN", f"--timeout={timeout}", f"--junitxml={xml}",
           "-o", "junit_family=xunit1", *extra]
    if keyword:
        cmd += ["-k", keyword]
    with open(log, "w") as fh:
        fh.write(" ".join(cmd) + "\n")
        fh.flush()
        return subprocess.run(cmd, cwd=root, env=env, stdout=fh, stderr=subprocess.STDOUT).returncode


def first_line(text: str | None) -> str:
    for line in (text or "").splitlines():
        line = line.strip()
        if line:
            return line[:300]
    return ""


def parse_junit(xml: Path) -> dict[str, dict]:
    """nodeid -> {outcome: passed|failed|error|skipped|xfailed|xpassed, message, seconds}."""
    results = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        parts = classname.split(".")
        # classname "tests.test_dpo_trainer.TestDPOTrainer" -> tests/test_dpo_trainer.py::TestDPOTrainer::name
        module_end = next((i for i, p in enumerate(parts) if p.startswith("test_")), len(parts) - 1)
        nodeid = "/".join(parts[: module_end + 1]) + ".py::" + "::".join(parts[module_end + 1:] + [name])
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "error"
                message = first_line(child.get("message")) or first_line(child.text)
            elif child.tag == "skipped":
                kind = child.get("type", "")
                outcome = "xfailed" if "xfail" in kind else "skipped"
                message = first_line(child.get("message"))
        results[nodeid] = {"outcome": outcome, "message": message, "seconds": float(case.get("time", 0) or 0)}
    return results


def classify(result: dict | None) -> str:
    if result is None:
        return "not run"
    if result["outcome"] in ("failed", "error") and MISSING_FIXTURE.search(result["message"]):
        return "missing fixture"
    return result["outcome"]


# ----------------------------------------------------------------------------------------------- reporting
def summarize(suite: str, meta: dict, trl: dict, ours: dict) -> tuple[dict, str]:
    names = sorted(set(trl) | set(ours))
    table = {n: {"trl": trl.get(n), "hf_verl": ours.get(n)} for n in names}
    on_trl = [n for n in names if trl.get(n, {}).get("outcome") == "passed"]
    compared = [n for n in on_trl if n in ours]
    both = [n for n in compared if ours[n]["outcome"] == "passed"]
    regress = [n for n in compared if ours[n]["outcome"] != "passed"]
    not_on_trl = [n for n in names if n in trl and trl[n]["outcome"] != "passed"]
    only_ours = [n for n in not_on_trl if ours.get(n, {}).get("outcome") == "passed"]
    counts = {"tests": len(names), "passed_on_trl": len(on_trl), "compared": len(compared),
              "passed_on_trl_and_hf_verl": len(both), "failed_on_hf_verl_only": len(regress),
              "not_passing_on_trl": len(not_on_trl), "passed_on_hf_verl_only": len(only_ours)}
    lines = [f"# TRL `{suite}` suite against hf_verl", "",
             f"TRL test files: {meta['trl_src']} @ {meta['trl_ref']} (VERSION {meta['trl_tests_version']}); "
             f"installed trl {meta['trl_installed']}; hf_verl from {meta['hf_verl_src']}; run {meta['date']}.", "",
             f"Import line(s) changed for hf_verl: {'; '.join(meta['rewritten']) or '(none)'}", ""]
    if meta.get("keyword"):
        rerun = f"Rerun here: the tests matching `-k {meta['keyword']!r}`; the others' outcomes are from earlier runs."
        lines += [rerun, ""]
    lines += ["| | count |", "|---|---|"]
    lines += [f"| {k.replace('_', ' ')} | {v} |" for k, v in counts.items()]
    lines += ["", f"**{len(both)} of the {len(compared)} tests that pass on TRL pass on hf_verl.**", "",
              "## Passing on TRL, not on hf_verl", "", "| test | hf_verl | first error line |", "|---|---|---|"]
    lines += [f"| `{n.split('::', 1)[1]}` | {ours[n]['outcome']} | {_cell(ours[n]['message'])} |" for n in regress]
    lines += ["", "## Not passing on TRL itself (not compared)", "", "| test | TRL | hf_verl | TRL's first error line |",
              "|---|---|---|---|"]
    lines += [f"| `{n.split('::', 1)[1]}` | {classify(trl[n])} | {classify(ours.get(n))} | "
              f"{_cell(trl[n]['message'])} |" for n in not_on_trl]
    return {"suite": suite, "meta": meta, "counts": counts, "tests": table}, "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")[:240]


# ----------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    import importlib.metadata

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", choices=list(SUITES), required=True)
    parser.add_argument("-k", dest="keyword", help="pytest -k expression (a subset of the tests)")
    parser.add_argument("--target", choices=["both", "trl", "hf_verl"], default="both",
                        help="hf_verl: reuse the TRL side stored in --out by an earlier run")
    parser.add_argument("--trl-src", default=os.environ.get("TRL_SRC", DEFAULT_TRL_SRC),
                        help="a TRL git directory or checkout (default $TRL_SRC or the fetched mirror)")
    parser.add_argument("--trl-ref", help="git ref of the TRL tests (default v<installed trl>, else HEAD)")
    parser.add_argument("--hub", default=os.path.join(tempfile.gettempdir(), "trl_suite_hub"),
                        help="where offline hubs are built, one per fixture version (reused while unchanged)")
    parser.add_argument("--out", help="results directory (default $TMPDIR/trl_suite/<suite>)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per test (pytest-timeout)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary test trees")
    parser.add_argument("--hf-verl-src", default=str(REPO),
                        help="the hf_verl source tree to test (default this checkout; e.g. a `git archive` of a "
                             "commit, for a before / after comparison)")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)

    out = Path(args.out or os.path.join(tempfile.gettempdir(), "trl_suite", args.suite))
    out.mkdir(parents=True, exist_ok=True)
    src = TrlSource(args.trl_src, args.trl_ref)
    print(f"TRL tests from {src.path} @ {src.ref} ({src.commit or ''}), VERSION {src.version}", flush=True)
    hf_home = build_hub(Path(args.hub), log=lambda m: print(m, flush=True))
    work = Path(tempfile.mkdtemp(prefix=f"trl_suite_{args.suite}_"))
    targets = ["trl", "hf_verl"] if args.target == "both" else [args.target]
    results: dict[str, dict] = {}
    rewritten: list[str] = []
    for target in targets:
        root = work / target
        changed = lay_out(src, args.suite, target, root)
        rewritten = rewritten or changed
        xml, log = out / f"{target}.xml", out / f"{target}.log"
        start = time.time()
        print(f"[{target}] running pytest (log: {log})", flush=True)
        run_pytest(root, args.suite, hf_home, xml, log, args.keyword, args.timeout, args.pytest_args,
                   Path(args.hf_verl_src).resolve())
        if not xml.exists():
            print(f"[{target}] pytest wrote no report; see {log}", flush=True)
            return 2
        results[target] = parse_junit(xml)
        passed = sum(r["outcome"] == "passed" for r in results[target].values())
        print(f"[{target}] {passed}/{len(results[target])} passed in {time.time() - start:.0f}s", flush=True)
        stored = out / f"{target}.json"
        merged = dict(results[target])
        if args.keyword and stored.exists():  # a subset updates the stored full run, test by test
            merged = {**json.loads(stored.read_text()), **merged}
        stored.write_text(json.dumps(merged, indent=1))
        results[target] = merged  # the summary covers the whole stored run, not only the subset
    for target in ("trl", "hf_verl"):
        if target not in results:
            stored = out / f"{target}.json"
            if not stored.exists():
                if args.target == "trl":
                    return 0  # the TRL side alone: nothing to compare with yet
                print(f"no stored {target} results in {out}: run with --target both first", flush=True)
                return 2
            results[target] = json.loads(stored.read_text())
    if not rewritten:
        _, rewritten = rewrite_imports(src.read(suite_file(args.suite)))
    meta = {"trl_src": str(src.path), "trl_ref": src.ref, "trl_commit": src.commit,
            "trl_tests_version": src.version, "trl_installed": importlib.metadata.version("trl"),
            "date": time.strftime("%Y-%m-%d %H:%M"), "rewritten": rewritten, "keyword": args.keyword,
            "hf_verl_src": str(Path(args.hf_verl_src).resolve())}
    ours = results["hf_verl"]
    trl = {n: r for n, r in results["trl"].items() if n in ours} if args.keyword else results["trl"]
    data, markdown = summarize(args.suite, meta, trl, ours)
    (out / "results.json").write_text(json.dumps(data, indent=1))
    (out / "summary.md").write_text(markdown)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    c = data["counts"]
    print(f"{c['passed_on_trl_and_hf_verl']} of {c['compared']} tests passing on TRL pass on hf_verl "
          f"({c['passed_on_trl']} pass on TRL of {c['tests']}); summary: {out / 'summary.md'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
