"""Prompt rendering, tokenisation, left-truncation and the bad-input messages."""

import pytest

from hf_verl.data.prompts import check_prompt_column, ensure_pad_token, is_conversational, tokenize_prompts
from tests.conftest import build_char_tokenizer


def test_standard_and_conversational_prompts(char_tokenizer):
    out = tokenize_prompts(["abc", [{"role": "user", "content": "hi"}]], char_tokenizer, None)
    assert out.texts[1] == "<user>hi\n<assistant>"
    assert char_tokenizer.decode(out.ids[0]) == "abc"
    assert out.ids[1][0] == char_tokenizer.convert_tokens_to_ids("<user>")
    assert out.num_truncated == 0


def test_left_truncation_keeps_the_end(char_tokenizer):
    out = tokenize_prompts(["abcdef", "ab"], char_tokenizer, max_prompt_length=3)
    assert char_tokenizer.decode(out.ids[0]) == "def" and out.num_truncated == 1


def test_bad_prompts(char_tokenizer):
    with pytest.raises(ValueError, match="prompt 1: empty prompt"):
        tokenize_prompts(["ok", "  "], char_tokenizer, None)
    with pytest.raises(ValueError, match="must be a string or a list"):
        tokenize_prompts([42], char_tokenizer, None)
    with pytest.raises(ValueError, match=r"no 'prompt' column; columns present: \['question'\]"):
        check_prompt_column(["question"])
    assert not is_conversational("text") and is_conversational([{"role": "user", "content": "x"}])


def test_pad_token_falls_back_to_eos():
    tok = build_char_tokenizer(pad=False)
    assert tok.pad_token_id is None
    ensure_pad_token(tok)
    assert tok.pad_token == "<eos>"
