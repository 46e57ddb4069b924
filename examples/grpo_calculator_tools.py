"""GRPO with a calculator tool: a tiny model that cannot add learns to call the calculator.

The model is a one-layer Llama built in code over a character-level tokenizer with a Hermes-style
chat template (tool schemas in the system turn, `<tool_call>` blocks, `<tool_response>` results).
To keep it small enough to train on a CPU in seconds, each well-formed calculator call is one added
token (`<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>` as a
single id), one per expression of the task, and the model is a bigram model: only its LM head
trains, reading the last token. At the start of its answer it writes one of the four call tokens
(about a third of the time in all) or a digit, then ends its turn. A direct digit is right one time
in ten; a call is right when it names the question's expression (one time in four for a model that
cannot read the question), and the trainer runs it and appends the result as a tool message,
attended but masked out of the loss. Rewards: `correct_direct_answer` (1 for the right digit
without a tool) and `correct_tool_use` (1 when a calculator result equals the answer). Calling beats
guessing, so GRPO raises the call tokens' odds: `tools/call_frequency` (TRL's metric: calls per
completion) rises from about 0.3 to 1 within about 20 steps, and the mean reward from about 0.1 to
about 0.25 (all this model can reach: choosing the call by the question needs attention, which the
example leaves frozen to stay stable at this learning rate).

Run: `python examples/grpo_calculator_tools.py` (CPU, 2 cores: about 1-2 minutes). Prints one line
per logged step and a before/after summary.
"""

from __future__ import annotations

import ast
import json
import operator
import string
import tempfile

import torch
from datasets import Dataset
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from hf_verl import GRPOConfig, GRPOTrainer

QUESTIONS = {"2+3": 5, "4+4": 8, "1+6": 7, "3*3": 9}
TEMPLATE = """
{%- if tools %}{{- '<|im_start|>system\\n<tools>' }}{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools><|im_end|>\\n' }}{%- endif %}
{%- for m in messages %}
  {%- if m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' + m.content }}
    {%- for call in m.tool_calls or [] %}{%- set f = call.function if call.function is defined else call %}
      {{- '<tool_call>\\n{"name": "' + f.name + '", "arguments": ' + (f.arguments | tojson) + '}\\n</tool_call>' }}
    {%- endfor %}{{- '<|im_end|>\\n' }}
  {%- elif m.role == 'tool' %}
    {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
    {{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}
    {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
  {%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of numbers, +, -, * and /.

    Args:
        expression: the expression to evaluate, e.g. "2+3"
    """

    def ev(node):
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        raise ValueError(f"not arithmetic: {expression!r}")

    value = ev(ast.parse(expression, mode="eval").body)
    return str(int(value) if float(value).is_integer() else value)


def call_text(expression: str) -> str:
    return f'<tool_call>\n{{"name": "calculator", "arguments": {json.dumps({"expression": expression})}}}\n</tool_call>'


def build_tokenizer() -> PreTrainedTokenizerFast:
    specials = ["<pad>", "<|im_end|>", "<|im_start|>"]
    chars = sorted(set(string.printable) - set("\x0b\x0c\r"))
    tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(specials + chars)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<pad>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    fast.add_tokens([call_text(e) for e in QUESTIONS])  # one id per well-formed call
    fast.chat_template = TEMPLATE
    return fast


def build_model(tok: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    """After the assistant header ("\\n"): each call token at logit 10.4, each digit at 10, the rest at 0; after a
    digit or a call: end the turn. The attention block starts near zero, so the choice first ignores the question."""
    torch.manual_seed(0)
    vocab = len(tok)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                                         tie_word_embeddings=False))
    ids = tok.convert_tokens_to_ids
    newline, eos, scale = ids("\n"), tok.eos_token_id, 1 / 128 ** 0.5  # the final norm scales one-hot rows by sqrt(128)
    with torch.no_grad():
        model.model.layers[0].self_attn.o_proj.weight.normal_(0.0, 0.03)
        model.model.layers[0].mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:, :vocab].copy_(torch.eye(vocab))
        model.lm_head.weight.zero_()
        for d in string.digits:
            model.lm_head.weight[ids(d), newline] = 10 * scale
            model.lm_head.weight[eos, ids(d)] = 20 * scale
        for e in QUESTIONS:
            model.lm_head.weight[ids(call_text(e)), newline] = 10.4 * scale
            model.lm_head.weight[eos, ids(call_text(e))] = 20 * scale
    # train what reads the context (attention) and what writes the choice (the LM head); the hand-set one-hot
    # embeddings and norms stay as built
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("lm_head"))
    return model


def _answer(prompt) -> int:
    return QUESTIONS[prompt[-1]["content"].removeprefix("what is ").removesuffix("?")]


def correct_direct_answer(prompts, completions, **kwargs) -> list[float]:
    """1 when the first assistant turn answers the question's value without calling a tool."""
    return [float(not c[0].get("tool_calls") and c[0]["content"].strip() == str(_answer(p)))
            for p, c in zip(prompts, completions)]


def correct_tool_use(prompts, completions, **kwargs) -> list[float]:
    """1 when a calculator result equals the question's value."""
    return [float(any(m["role"] == "tool" and m["content"] == str(_answer(p)) for m in c))
            for p, c in zip(prompts, completions)]


def main(max_steps: int = 40, output_dir: str | None = None) -> list[dict]:
    tok = build_tokenizer()
    prompts = [[{"role": "user", "content": f"what is {e}?"}] for e in QUESTIONS] * 16
    args = GRPOConfig(output_dir=output_dir or tempfile.mkdtemp(), use_cpu=True, report_to=[], max_steps=max_steps,
                      logging_steps=5, logging_first_step=True, per_device_train_batch_size=16, num_generations=8, max_completion_length=160,
                      max_tool_calling_iterations=1, learning_rate=3e-2, beta=0.0, gradient_checkpointing=False,
                      save_strategy="no", disable_tqdm=True, seed=0)
    trainer = GRPOTrainer(model=build_model(tok), reward_funcs=[correct_direct_answer, correct_tool_use], args=args,
                          train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tok,
                          tools=[calculator])
    trainer.train()
    logs = [h for h in trainer.state.log_history if "tools/call_frequency" in h]
    print(f"{'step':>5} {'tool calls/completion':>22} {'correct tool use':>17} {'reward':>7}")
    for h in logs:
        print(f"{h['step']:>5} {h['tools/call_frequency']:>22.2f} {h['rewards/correct_tool_use/mean']:>17.2f} "
              f"{h['reward']:>7.2f}")
    print(f"tool calls per completion: {logs[0]['tools/call_frequency']:.2f} at step {logs[0]['step']} -> "
          f"{logs[-1]['tools/call_frequency']:.2f} at step {logs[-1]['step']}")
    return logs


if __name__ == "__main__":
    main()
