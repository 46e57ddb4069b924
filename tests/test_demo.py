"""The embedded demo, run as a user runs it: RL must lift held-out accuracy by 50+ points; each run gets its own
folder, and its trained model loads with `from_pretrained` and serves with `hf-verl serve`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_verl.cli import build_parser
from tests.test_demo_figures import demo_run


def test_help_names_the_real_use_options(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["demo", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for opt in ("--model", "--dataset", "--output-dir", "--max-steps", "--learning-rate", "--dpo-loss"):
        assert opt in out


def test_reverse_reward_is_exact_match():
    from hf_verl.demo.task import reverse_reward

    assert reverse_reward(["abc="] * 3, ["cba", "cba<eos>", "abc"], answer=["cba"] * 3) == [1.0, 1.0, 0.0]
    assert reverse_reward(["abc="], ["cba"]) == [1.0]  # no answer column: the rule itself


def test_moving_average_is_a_trailing_mean():
    from hf_verl.demo.run import moving_average

    assert moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert moving_average([2.0, 4.0], 5) == [2.0, 3.0]  # fewer values than the window: the mean so far
    assert moving_average([], 3) == []


def test_unknown_algo_is_refused():
    from hf_verl.demo.entry import run_demo

    with pytest.raises(ValueError, match="--algo must be one of"):
        run_demo("/tmp/unused", algo="sft")


def test_asynchronous_rollout_modes_take_half_the_learning_rate(tmp_path):
    """The demo's recipe for stale rounds (docs/rollout.md): GRPO at half the peak rate, unless one is given; DPO
    has no rounds to generate and refuses the option."""
    import json

    from hf_verl.demo.entry import run_demo

    tiny = {"max_steps": 2, "warmup_max_steps": 1, "prompts_per_step": 2, "num_generations": 2, "disable_tqdm": True}
    partial = run_demo(str(tmp_path), algo="grpo", rollout="partial", **tiny)
    given = run_demo(str(tmp_path), algo="grpo", rollout="async", learning_rate=1e-4, **tiny)
    rates = [json.loads(Path(r.files[-1]).read_text())["recipe"]["learning_rate"] for r in (partial, given)]
    assert rates == [2.5e-4, 1e-4]
    assert partial.rl_steps == 2
    with pytest.raises(ValueError, match=r"--rollout async is for --algo grpo\|ppo"):
        run_demo(str(tmp_path), algo="dpo", rollout="async")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A whole demo run, shrunk to seconds (2 GRPO steps of 2 prompts x 2 completions, a 1-step warm-up)."""
    import torch

    from hf_verl.demo.entry import run_demo

    root = tmp_path_factory.mktemp("demo")
    threads = torch.get_num_threads()
    result = run_demo(str(root), algo="grpo", max_steps=2, warmup_max_steps=1, prompts_per_step=2,
                      num_generations=2, disable_tqdm=True)
    assert torch.get_num_threads() == threads  # the run's single thread does not outlive it
    return root, result


def test_the_built_in_demo_runs_on_one_thread(tiny_run):
    # its figures then do not depend on the core count (README's table is measured so)
    summary = json.loads(open(os.path.join(tiny_run[1].output_dir, "summary.json")).read())
    assert summary["torch_threads"] == 1


def test_run_folders_are_never_reused_and_latest_follows_the_last(tmp_path):
    from hf_verl.demo.outputs import latest_run, new_run_dir, point_latest

    first = new_run_dir(str(tmp_path), "grpo", 0, now=0.0)
    second = new_run_dir(str(tmp_path), "grpo", 0, now=0.0)  # the same second: a suffix, not the same folder
    other = new_run_dir(str(tmp_path), "dpo", 1, now=0.0)
    assert first != second and second == first + "-2" and os.path.dirname(other) == str(tmp_path / "dpo")
    assert os.path.basename(first).endswith("-seed0") and os.path.basename(other).endswith("-seed1")
    (tmp_path / "grpo" / os.path.basename(first) / "summary.json").write_text("{}")
    point_latest(str(tmp_path), first)
    assert latest_run(str(tmp_path)) == os.path.realpath(first)
    point_latest(str(tmp_path), other)
    assert latest_run(str(tmp_path)) == os.path.realpath(other)
    assert (tmp_path / "grpo" / os.path.basename(first) / "summary.json").exists()  # the earlier run is kept


def test_demo_saves_a_model_that_loads_with_from_pretrained(tiny_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_verl.demo.outputs import latest_run
    from hf_verl.demo.run import greedy_accuracy
    from hf_verl.demo.task import make_split

    root, result = tiny_run
    assert latest_run(str(root)) == os.path.realpath(result.output_dir)
    assert os.path.dirname(result.output_dir) == str(root / "grpo")
    summary = json.loads(open(os.path.join(result.output_dir, "summary.json")).read())
    assert summary["model_dir"] == result.model_dir == os.path.join(result.output_dir, "model")
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json"):
        assert os.path.exists(os.path.join(result.model_dir, name)), name
    model = AutoModelForCausalLM.from_pretrained(result.model_dir)
    tok = AutoTokenizer.from_pretrained(result.model_dir)
    split = make_split(seed=0)
    assert greedy_accuracy(model, tok, split.heldout_prompts, split.heldout_answers) == summary["accuracy_after"]


def test_saved_demo_model_serves_to_the_openai_client(tiny_run):
    """What docs/saving_and_serving.md does: serve the saved folder, query it with `openai`; the served greedy
    completions equal the saved model's own."""
    openai = pytest.importorskip("openai")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_verl.demo.run import greedy_completions
    from hf_verl.rollout.hf_engine import TransformersEngine
    from hf_verl.serve.server import RolloutServer

    model_dir = tiny_run[1].model_dir
    model, tok = AutoModelForCausalLM.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
    prompts = ["abcde=", "jihgf=", "aabbc="]
    want = greedy_completions(model, tok, prompts)
    server = RolloutServer(TransformersEngine(model.eval(), tok), tok, "demo", port=0).start()
    try:
        client = openai.OpenAI(base_url=f"{server.address}/v1", api_key="unused", max_retries=0, timeout=60)
        out = client.completions.create(model="demo", prompt=prompts, max_tokens=6, temperature=0)
    finally:
        server.shutdown()
    assert [c.text for c in out.choices] == want


def test_demo_report_names_the_model_and_the_commands(tiny_run, capsys):
    from hf_verl.cli import print_summary

    result = tiny_run[1]
    print_summary(result)
    out = capsys.readouterr().out
    assert f"hf-verl serve {result.model_dir}" in out
    assert f"AutoModelForCausalLM.from_pretrained({result.model_dir!r})" in out
    assert "source .venv/bin/activate" in out and result.latest in out


@pytest.mark.slow
@pytest.mark.parametrize("algo, key", [("grpo", "reward"), ("ppo", "objective/scores"),
                                       ("dpo", "rewards/accuracies")])
def test_demo_learns(tmp_path_factory, algo, key):
    # a fixed step count (no --rl-seconds budget): the outcome depends on learning, not on the clock; the run is
    # shared with tests/test_demo_figures.py (one per algo and seed per session)
    run, stdout = demo_run(algo, 0, tmp_path_factory.getbasetemp() / "demo-runs")
    assert "held-out greedy accuracy before RL" in stdout
    summary = json.loads((run / "summary.json").read_text())
    assert summary["accuracy_after"] - summary["accuracy_before"] >= 0.50, summary
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rewards = [x[key] for x in lines if key in x]
    # PPO scores once per rollout (2 epochs x 2 mini-batches = 4 optimizer steps)
    assert summary["rl_steps"] == 500  # never cut short
    assert len(rewards) == summary["rl_steps"] // (4 if algo == "ppo" else 1) > 50
    assert sum(rewards[-20:]) / 20 > sum(rewards[:20]) / 20  # reward rises during RL
    assert (run / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run / "model" / "model.safetensors").exists() and f"hf-verl serve {run / 'model'}" in stdout
    if algo == "dpo":
        assert summary["preference_accuracy_after"] - summary["preference_accuracy_before"] >= 0.5


@pytest.mark.slow
def test_offline_quickstart_runs_as_documented(tmp_path):
    """docs/quickstart.md's offline command, run as printed (from a fresh folder): it trains, saves and reloads."""
    script = Path(__file__).resolve().parents[1] / "examples" / "quickstart_offline.py"
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "after 100 steps" in proc.stdout
    assert (tmp_path / "quickstart-offline" / "final" / "model.safetensors").exists()
