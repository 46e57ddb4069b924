"""Shared fixtures: tiny character-level tokenizers with chat templates (a plain one and a Hermes-style
tool-calling one), built in code."""

import json
import string

import pytest

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def build_char_tokenizer(pad: bool = True):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<user>", "<assistant>", "<system>"]
    chars = list("abcdefghijklmnopqrstuvwxyz0123456789 .,?!:=+-\n")
    vocab = {t: i for i, t in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>",
                                   pad_token="<pad>" if pad else None)
    fast.add_special_tokens({"additional_special_tokens": specials[2:]})
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_bpe_tokenizer():
    """A ByteLevel BPE tokenizer trained in-process (a different vocabulary from the char one)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, how are you?",
              "the answer is 42", "reverse the letters abcde"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


@pytest.fixture
def char_tokenizer():
    return build_char_tokenizer()


# A Hermes / Qwen2.5-style chat template (tools in the system turn, <tool_call> blocks, tool results as
# <tool_response> blocks of one user turn), written for these tests.
HERMES_TEMPLATE = """
{%- if tools %}
    {{- '<|im_start|>system\\n<tools>' }}
    {%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
    {{- '\\n</tools><|im_end|>\\n' }}
{%- endif %}
{%- for m in messages %}
    {%- if m.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' + m.content }}
        {%- for call in m.tool_calls or [] %}
            {%- set f = call.function if call.function is defined else call %}
            {{- '<tool_call>\\n{"name": "' + f.name + '", "arguments": ' }}
            {{- (f.arguments | tojson) + '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif m.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- else %}
        {{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


def build_hermes_tokenizer():
    """A character-level tokenizer over printable ASCII, `<|im_end|>` as EOS, with the Hermes template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<|im_end|>", "<|im_start|>"]
    chars = sorted(set(string.printable) - set("\x0b\x0c\r"))
    tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(specials + chars)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<pad>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    fast.chat_template = HERMES_TEMPLATE
    return fast


def call_text(name, arguments):
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'
