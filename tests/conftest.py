"""Shared fixtures: a tiny character-level tokenizer with a chat template, built in code."""

import pytest

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def build_char_tokenizer(pad: bool = True):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<user>", "<assistant>", "<system>"]
    chars = list("abcdefghijklmnopqrstuvwxyz0123456789 .,?!:=+-\n")
    vocab = {t: i for i, t in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>",
                                   pad_token="<pad>" if pad else None)
    fast.add_special_tokens({"additional_special_tokens": specials[2:]})
    fast.chat_template = CHAT_TEMPLATE
    return fast


@pytest.fixture
def char_tokenizer():
    return build_char_tokenizer()
