"""`ChatMLCollator`: prompt / completion batches for distillation, as TRL's `DataCollatorForChatML` makes them.

Each example is one of:

- conversational: `messages` (the last message is the completion; the prompt is the chat template of the others
  with the generation prompt, or the example's `prompt` text when it has one, TRL's convention);
- prompt / completion text (hf_verl's addition): `prompt` and `completion` strings, tokenised as they are (no chat
  template), the completion followed by the tokenizer's EOS;
- tokenised: `input_ids` (and optionally `attention_mask`, and `completion_mask` marking where the completion
  starts).

The batch holds TRL's keys: `input_ids`, `attention_mask`, `labels` (-100 on the prompt and padding), `prompts`
and `prompt_attention_mask`, all left-padded. Sequences longer than `max_length` keep their last `max_length`
tokens (the oldest prompt context goes first).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hf_verl.data.batch import pad_sequences

IGNORE_INDEX = -100


@dataclass
class ChatMLCollator:
    """See the module docstring.

    Args:
        tokenizer: the student's tokenizer (with a pad token).
        max_length (`int`, *optional*): the longest sequence kept (default `min(model_max_length, 1024)`).
        ignore_index (`int`, defaults to `-100`): the label of positions that do not count.
        prompt_key / messages_key (`str`): the column names.
    """

    tokenizer: Any
    max_length: int | None = None
    ignore_index: int = IGNORE_INDEX
    prompt_key: str = "prompt"
    messages_key: str = "messages"

    def __post_init__(self) -> None:
        if self.tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer has no pad token: set tokenizer.pad_token (e.g. to its eos_token).")
        if self.max_length is None:
            self.max_length = min(self.tokenizer.model_max_length, 1024)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def example_ids(self, example: dict) -> tuple[list[int], int]:
        """`(token ids, prompt length)` of one example, truncated from the left to `max_length`.

        Raises:
            ValueError: an example of no known format, or one whose prompt is entirely truncated away.
        """
        if "input_ids" in example:
            ids = list(example["input_ids"])
            mask = example.get("completion_mask")
            if mask is not None:
                mask = list(mask)
                prompt_len = mask.index(1) if 1 in mask else len(ids)
            else:
                prompt_len = min(len(self._encode(example[self.prompt_key])), len(ids))
        elif self.messages_key in example:
            messages = example[self.messages_key]
            prompt = example.get(self.prompt_key)
            if not isinstance(prompt, str):
                prompt = self.tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=False)
            full = self.tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
            ids, prompt_len = self._encode(full), len(self._encode(prompt))
        elif isinstance(example.get(self.prompt_key), str) and isinstance(example.get("completion"), str):
            prompt_ids = self._encode(example[self.prompt_key])
            eos = [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
            ids, prompt_len = prompt_ids + self._encode(example["completion"]) + eos, len(prompt_ids)
        else:
            raise ValueError(f"a distillation example needs `{self.messages_key}` (conversational), `prompt` and "
                             f"`completion` texts, or `input_ids`; got columns {sorted(example)}.")
        if len(ids) > self.max_length:
            prompt_len = max(0, prompt_len - (len(ids) - self.max_length))
            ids = ids[-self.max_length:]
        if prompt_len == 0:
            raise ValueError(f"an example has no prompt tokens left after truncation to max_length={self.max_length} "
                             "(the completion fills the window): increase max_length.")
        return ids, prompt_len

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        pad = self.tokenizer.pad_token_id
        seqs, prompts, labels = [], [], []
        for example in examples:
            ids, prompt_len = self.example_ids(example)
            seqs.append(ids)
            prompts.append(ids[:prompt_len])
            labels.append([self.ignore_index] * prompt_len + ids[prompt_len:])
        input_ids, attention_mask = pad_sequences(seqs, pad, side="left")
        label_ids, _ = pad_sequences(labels, self.ignore_index, side="left")
        prompt_ids, prompt_mask = pad_sequences(prompts, pad, side="left")
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": label_ids,
                "prompts": prompt_ids, "prompt_attention_mask": prompt_mask}
