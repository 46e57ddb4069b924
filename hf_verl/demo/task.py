"""The demo's verifiable task: reverse a 5-letter string over the letters a-j.

A prompt is ``"abcde="``; the expected completion is ``"edcba"`` followed by EOS. The reward is
an exact-match rule on the decoded completion, checked against the dataset's ``answer`` column
(TRL's convention: ``reward_func(prompts, completions, completion_ids, **columns)``).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

logger = logging.getLogger(__name__)

ALPHABET = "abcdefghij"
LENGTH = 5
SEPARATOR = "="


def make_prompt(word: str) -> str:
    return f"{word}{SEPARATOR}"


def target(word: str) -> str:
    return word[::-1]


@dataclass
class TaskSplit:
    train_words: list[str]
    heldout_words: list[str]

    @property
    def train_prompts(self) -> list[str]:
        return [make_prompt(w) for w in self.train_words]

    @property
    def heldout_prompts(self) -> list[str]:
        return [make_prompt(w) for w in self.heldout_words]

    @property
    def train_answers(self) -> list[str]:
        return [target(w) for w in self.train_words]

    @property
    def heldout_answers(self) -> list[str]:
        return [target(w) for w in self.heldout_words]


def make_split(num_train: int = 2000, num_heldout: int = 256, seed: int = 0) -> TaskSplit:
    """Disjoint train / held-out word sets drawn from all 10**5 strings."""
    rng = random.Random(seed)
    total = len(ALPHABET) ** LENGTH
    if num_train + num_heldout > total:
        raise ValueError(f"at most {total} distinct words exist; asked for {num_train + num_heldout}.")
    idx = rng.sample(range(total), num_train + num_heldout)
    words = ["".join(ALPHABET[(i // len(ALPHABET) ** p) % len(ALPHABET)] for p in range(LENGTH)) for i in idx]
    return TaskSplit(train_words=words[:num_train], heldout_words=words[num_train:])


def _clean(completion) -> str:
    if isinstance(completion, list):  # conversational: [{"role": "assistant", "content": ...}]
        completion = completion[-1]["content"] if completion else ""
    return str(completion).replace("<eos>", "").strip()


def reverse_reward(prompts, completions, completion_ids=None, answer=None, **kwargs) -> list[float]:
    """1.0 where the completion (EOS/whitespace stripped) equals `answer`, else 0.0."""
    if answer is None:  # fall back to the rule itself
        answer = [target(_clean(p).rstrip(SEPARATOR)) for p in prompts]
    return [1.0 if _clean(c) == str(a).strip() else 0.0 for c, a in zip(completions, answer)]


def build_char_tokenizer(alphabet: str = ALPHABET + SEPARATOR):
    """A character-level `PreTrainedTokenizerFast` with `<pad>` and `<eos>`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1}
    for ch in alphabet:
        vocab.setdefault(ch, len(vocab))
    vocab.setdefault("<unk>", len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    out.padding_side = "left"
    return out


