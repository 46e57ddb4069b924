"""benchmarks/gpu_check.sh in its CPU mode: the same sections as on a GPU (GRPO with colocated vLLM and DPO against
TRL, the planner's estimate against the measured peak, the weight sync into vLLM, the Megatron step), on tiny models,
so that the GPU check cannot rot between the rare sessions that are lent a GPU."""

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.optional_backend]
ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("grpo_vllm", "dpo", "memory", "weight_sync", "megatron")


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def check(tmp_path_factory):
    for module in ("trl", "vllm", "megatron.core"):
        pytest.importorskip(module)
    out = tmp_path_factory.mktemp("gpu_check")
    t0 = time.monotonic()
    proc = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--cpu"], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, OUT=str(out), PYTHON=sys.executable), timeout=600, check=False)
    seconds = time.monotonic() - t0
    log = "".join(f"{p.name}:\n{p.read_text()[-2000:]}\n" for p in sorted(out.glob("gpu_check.*.log")))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + log[-3000:]
    return json.loads((out / "gpu_check.json").read_text()), (out / "gpu_check.md").read_text(), seconds, log


def test_every_section_measured_with_finite_positive_numbers(check):
    record, _, seconds, log = check
    assert record["mode"] == "cpu" and seconds < 400
    failed = {n: e.get("error", "")[-1500:] for n, e in record["sections"].items() if e["status"] != "ok"}
    assert not failed, f"{failed}\n{log[-3000:]}"
    assert tuple(record["sections"]) == SECTIONS
    for name, entry in record["sections"].items():
        assert entry["rows"], name
        for row in entry["rows"]:
            assert _positive(row["value"]) and _positive(row["against"]), row
            assert row["ratio"] is None or _positive(row["ratio"]), row


def test_trainers_against_trl_and_vllm_sync(check):
    record = check[0]["sections"]
    for name in ("grpo_vllm", "dpo"):
        runs = record[name]["result"]["runs"]
        assert set(runs) == {"hf_verl", "trl"}
        assert all(_positive(r["steps_per_s"]) and _positive(r["peak_rss_mib"]) for r in runs.values())
        assert {r["measurement"].split(": ")[1] for r in record[name]["rows"]} == {"optimizer steps/s", "peak RSS"}
    assert record["grpo_vllm"]["result"]["cell"] == "cpu-grpo-vllm"
    sync = record["weight_sync"]["result"]
    assert _positive(sync["seconds_per_gb"]) and sync["bytes"] > 30e6  # the 10M-parameter model in fp32
    assert sync["greedy_ok"]  # the engine generates what the trainer's model does after the sync
    megatron = record["megatron"]["result"]["runs"]
    assert set(megatron) == {"plain", "mcore-tp1"} and all(_positive(r["step_s"]) for r in megatron.values())


def test_estimate_against_measured_on_three_layouts(check):
    configs = check[0]["sections"]["memory"]["result"]["configs"]
    assert [c["config"] for c in configs] == ["cpu-t-128", "cpu-t-256-ckpt", "cpu-t-128-ref"]
    for c in configs:
        assert c["ratio"] == pytest.approx(c["compared_estimate_bytes"] / c["measured_bytes"])
        assert c["compared_estimate_bytes"] == c["estimate_bytes"]  # on a CPU the RSS includes the runtime
        assert 0.5 < c["ratio"] < 2.0, c  # the memory model is within a factor of 2 of the peak RSS
    ref = next(c for c in configs if c["config"] == "cpu-t-128-ref")
    assert any(k.startswith("reference") for k in ref["breakdown"])


def test_markdown_table_has_a_row_per_measurement(check):
    record, md, _, _ = check
    rows = [ln for ln in md.splitlines() if ln.startswith("| ") and not ln.startswith("| section")]
    measured = [r for e in record["sections"].values() for r in e["rows"]]
    assert len(rows) == len(measured) == 2 + 2 + 3 + 1 + 3
    for r in measured:
        assert any(f"| {r['section']} | {r['measurement']} |" in ln for ln in rows), r
    memory = [ln for ln in rows if ln.startswith("| memory |")]
    assert all("estimate" in ln and "measured" in ln and ln.split("|")[5].strip() != "—" for ln in memory)
