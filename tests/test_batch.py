"""RolloutBatch padding, validation, moves and slicing; SamplingParams and GenerationOutput checks."""

import pytest
import torch

from hf_verl.data.batch import RolloutBatch, pad_sequences
from hf_verl.rollout.base import GenerationOutput, SamplingParams


def _batch():
    return RolloutBatch.from_lists([[1, 2, 3], [4]], [[5], [6, 7]], pad_token_id=0,
                                   sampling_logprobs=[[-0.1], [-0.2, -0.3]],
                                   meta={"prompt": ["a", "b"]})


def test_from_lists_pads_prompts_left_and_completions_right():
    b = _batch()
    assert b.prompt_ids.tolist() == [[1, 2, 3], [0, 0, 4]]
    assert b.prompt_mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert b.completion_ids.tolist() == [[5, 0], [6, 7]]
    assert b.completion_mask.tolist() == [[1, 0], [1, 1]]
    assert torch.allclose(b.sampling_logprobs, torch.tensor([[-0.1, 0.0], [-0.2, -0.3]]))
    assert b.input_ids.shape == (2, 5) and b.num_completion_tokens == 3


def test_validate_names_the_bad_field():
    b = _batch()
    b.rewards = torch.zeros(3)
    with pytest.raises(ValueError, match=r"RolloutBatch.rewards has shape \(3,\)"):
        b.validate()
    b.rewards = torch.zeros(2, dtype=torch.long)
    with pytest.raises(TypeError, match="rewards must be floating"):
        b.validate()
    b.rewards = None
    b.meta["prompt"] = ["only one"]
    with pytest.raises(ValueError, match="meta\\['prompt'\\]"):
        b.validate()


def test_select_split_and_to():
    b = _batch()
    b.rewards = torch.tensor([1.0, 2.0])
    second = b.select([1])
    assert second.completion_ids.tolist() == [[6, 7]] and second.meta["prompt"] == ["b"]
    assert [p.batch_size for p in b.split(1)] == [1, 1]
    half = b.to("cpu", dtype=torch.float64)
    assert half.rewards.dtype == torch.float64 and half.prompt_ids.dtype == torch.long


def test_pad_sequences_rejects_overlong():
    with pytest.raises(ValueError, match="length 3 > pad width 2"):
        pad_sequences([[1, 2, 3]], 0, side="right", width=2)


def test_sampling_params_validation():
    assert SamplingParams(max_new_tokens=4, temperature=0.0).greedy
    assert SamplingParams(max_new_tokens=4, stop="\n").stop == ("\n",)
    for bad in ({"max_new_tokens": 0}, {"max_new_tokens": 1, "top_p": 0.0},
                {"max_new_tokens": 1, "top_k": -1}, {"max_new_tokens": 1, "temperature": -1}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_generation_output_checks_alignment():
    with pytest.raises(ValueError, match="completion 0 has 2 tokens but 1 log-probs"):
        GenerationOutput([[1, 2]], [[-0.1]], ["stop"])
    with pytest.raises(ValueError, match="unknown finish reasons"):
        GenerationOutput([[1]], [[-0.1]], ["eos"])


def test_import_is_light():
    import subprocess
    import sys

    code = "import sys, hf_verl; print('torch' in sys.modules, hf_verl.__version__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split()[0] == "False"
