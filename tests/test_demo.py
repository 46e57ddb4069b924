"""The embedded demo, run as a user runs it: RL must lift held-out accuracy by 20+ points."""

import json
import subprocess
import sys

import pytest

from hf_verl.cli import build_parser


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


def test_unknown_algo_is_refused():
    from hf_verl.demo.run import run_demo

    with pytest.raises(ValueError, match="--algo must be one of"):
        run_demo("/tmp/unused", algo="sft")


@pytest.mark.slow
@pytest.mark.parametrize("algo, key", [("grpo", "reward"), ("ppo", "objective/scores"),
                                       ("dpo", "rewards/accuracies")])
def test_demo_learns(tmp_path, algo, key):
    # a fixed step count (no --rl-seconds budget): the outcome depends on learning, not on the clock
    proc = subprocess.run([sys.executable, "-m", "hf_verl", "demo", "--algo", algo, "--output-dir", str(tmp_path),
                           "--max-steps", "500"], capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "held-out greedy accuracy before RL" in proc.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["accuracy_after"] - summary["accuracy_before"] >= 0.20, summary
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rewards = [x[key] for x in lines if key in x]
    # PPO scores once per rollout (2 epochs x 2 mini-batches = 4 optimizer steps)
    assert summary["rl_steps"] == 500  # never cut short
    assert len(rewards) == summary["rl_steps"] // (4 if algo == "ppo" else 1) > 50
    assert sum(rewards[-20:]) / 20 > sum(rewards[:20]) / 20  # reward rises during RL
    assert (tmp_path / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if algo == "dpo":
        assert summary["preference_accuracy_after"] - summary["preference_accuracy_before"] >= 0.5
