"""`hf-verl demo --algo distill`, run as a user runs it: a GRPO-trained teacher distilled on-policy into a student
with another tokenizer (the cross-tokenizer mode) must lift the student's held-out accuracy by 50+ points."""

import json
from pathlib import Path

import pytest

from hf_verl.cli import build_parser


def test_the_demo_offers_distill():
    args = build_parser().parse_args(["demo", "--algo", "distill"])
    assert args.algo == "distill"


def test_distill_refuses_a_model_of_the_users():
    from hf_verl.demo.entry import run_demo

    with pytest.raises(ValueError, match="built-in task and models"):
        run_demo("/tmp/unused", algo="distill", model_name="org/model")


@pytest.mark.slow
def test_distill_demo_lifts_the_student_across_tokenizers(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_verl.demo.distill import build_student_tokenizer
    from hf_verl.demo.entry import run_demo
    from hf_verl.demo.run import greedy_accuracy
    from hf_verl.demo.task import build_char_tokenizer, make_split

    result = run_demo(str(tmp_path), algo="distill", disable_tqdm=True)
    run = Path(result.output_dir)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["mode"] == "cross_tokenizer"
    assert build_student_tokenizer().get_vocab() != build_char_tokenizer().get_vocab()
    assert result.extra["teacher_accuracy"] >= 0.8, result.extra
    assert result.accuracy_after - result.accuracy_before >= 0.5, (result.accuracy_before, result.accuracy_after)
    losses = [json.loads(line).get("loss") for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [x for x in losses if x is not None]
    assert len(losses) == 200 and sum(losses[-20:]) < 0.25 * sum(losses[:20])  # the sampled reverse KL falls
    # the saved student is the one measured: it loads and scores the same held-out accuracy with its own tokenizer
    model = AutoModelForCausalLM.from_pretrained(result.model_dir)
    tokenizer = AutoTokenizer.from_pretrained(result.model_dir)
    split = make_split(seed=0)
    assert greedy_accuracy(model, tokenizer, split.heldout_prompts, split.heldout_answers) == result.accuracy_after
