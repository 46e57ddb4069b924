"""Reward-function calling convention, validation messages and weighting, by hand."""

import asyncio

import pytest
import torch

from hf_verl.rewards.callables import combine_rewards, score_reward_funcs


def length(completions, **kw):
    return [float(len(c)) for c in completions]


async def async_bonus(completions, bonus, **kw):
    await asyncio.sleep(0)
    return [b if c else None for c, b in zip(completions, bonus)]


def _score(funcs, completions=("ab", "")):
    return score_reward_funcs(funcs, prompts=["p"] * len(completions), completions=list(completions),
                              completion_ids=[[1]] * len(completions), columns={"bonus": [0.5, 2.0]})


def test_sync_async_columns_and_none():
    out = _score([length, async_bonus])
    assert out.shape == (2, 2)
    assert out[:, 0].tolist() == [2.0, 0.0]
    assert out[0, 1].item() == 0.5 and torch.isnan(out[1, 1])


@pytest.mark.parametrize(
    "ret, match",
    [
        ([1.0], "returned 1 rewards for 2 samples"),
        ([1.0, float("nan")], "returned nan for sample 1"),
        ([1.0, "x"], "non-number for sample 1: str 'x'"),
        (3.0, "must return a list of floats, got float"),
    ],
)
def test_bad_reward_outputs_name_function_and_sample(ret, match):
    def broken(**kw):
        return ret

    with pytest.raises(ValueError, match=f"'broken'.*{match}|{match}"):
        _score([broken])


def test_combine_rewards_with_weights():
    per = torch.tensor([[1.0, 2.0], [float("nan"), 4.0], [float("nan"), float("nan")]])
    assert combine_rewards(per, [0.5, 2.0]).tolist() == [4.5, 8.0, 0.0]
    with pytest.raises(ValueError, match="reward_weights has 1 entries but there are 2"):
        combine_rewards(per, [1.0])


def test_a_reward_model_reads_the_score_before_its_tokenizers_padding():
    """TRL sets the reward model's pad_token_id to its tokenizer's: the score is read at the last token before
    that padding, so a padded batch scores each text as it scores alone; a pad token outside the vocabulary
    falls back to EOS."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from hf_verl.rewards.reward_model import RewardModelScorer
    from tests.conftest import build_char_tokenizer

    tok = build_char_tokenizer()
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(Qwen2Config(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=len(tok), num_labels=1, pad_token_id=tok.convert_tokens_to_ids("a")))  # disagrees with tok
    tok.pad_token = "<|not-in-vocab|>"
    scorer = RewardModelScorer(model, tok)
    batch = scorer(["ab", "b"], ["aaaa", "c"])
    alone = [scorer([p], [c])[0] for p, c in (("ab", "aaaa"), ("b", "c"))]
    assert tok.pad_token == tok.eos_token and model.config.pad_token_id == tok.eos_token_id
    assert batch == pytest.approx(alone, abs=1e-5)
