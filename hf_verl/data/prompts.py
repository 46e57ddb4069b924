"""Prompt datasets: format detection, column checks, chat templates and left-truncation.

Two formats, as in TRL: *standard* rows have a `prompt` string; *conversational* rows have a
`prompt` list of `{"role", "content"}` messages, rendered with the tokenizer's chat template
(generation prompt appended). Every other column of the row is passed through to the reward
functions.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


def check_prompt_column(column_names: Sequence[str], prompt_column: str = "prompt") -> None:
    """Raise a ValueError naming the missing column and the columns present."""
    if prompt_column not in column_names:
        raise ValueError(
            f"the dataset has no {prompt_column!r} column; columns present: {sorted(column_names)}. "
            f"Rename the column holding the prompts to {prompt_column!r} "
            "(dataset.rename_column(old, 'prompt'))."
        )


def is_conversational(prompt: Any) -> bool:
    """True for a list of message dicts with a 'role' key (TRL's conversational format)."""
    return (
        isinstance(prompt, list)
        and len(prompt) > 0
        and all(isinstance(m, Mapping) and "role" in m for m in prompt)
    )


def render_prompt(prompt: Any, tokenizer: Any, chat_template_kwargs: dict | None = None) -> str:
    """The text of one prompt: itself if a string, else the chat template with generation prompt."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError("empty prompt: every prompt must contain text.")
        return prompt
    if is_conversational(prompt):
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                "conversational prompts need a tokenizer with a chat template; set "
                "tokenizer.chat_template or pass prompts as plain strings."
            )
        return tokenizer.apply_chat_template(
            list(prompt), tokenize=False, add_generation_prompt=True, **(chat_template_kwargs or {})
        )
    raise ValueError(
        f"a prompt must be a string or a list of {{'role', 'content'}} messages, got {type(prompt).__name__}: "
        f"{str(prompt)[:80]!r}."
    )


@dataclass
class TokenizedPrompts:
    """Token ids of a batch of prompts after left-truncation, plus how many were truncated."""

    texts: list[str]
    ids: list[list[int]]
    num_truncated: int


def tokenize_prompts(
    prompts: Sequence[Any],
    tokenizer: Any,
    max_prompt_length: int | None,
    chat_template_kwargs: dict | None = None,
) -> TokenizedPrompts:
    """Render and tokenise prompts; keep the last `max_prompt_length` tokens (left-truncation).

    Special tokens are added for standard prompts (as the tokenizer does by default) and not for
    conversational ones, whose template already contains them.
    """
    texts, ids, truncated = [], [], 0
    for i, prompt in enumerate(prompts):
        try:
            text = render_prompt(prompt, tokenizer, chat_template_kwargs)
        except ValueError as err:
            raise ValueError(f"prompt {i}: {err}") from None
        tok = tokenizer(text, add_special_tokens=not is_conversational(prompt))["input_ids"]
        if not tok:
            raise ValueError(f"prompt {i} tokenises to no tokens: {text[:80]!r}.")
        if max_prompt_length is not None and len(tok) > max_prompt_length:
            tok = tok[-max_prompt_length:]
            truncated += 1
        texts.append(text)
        ids.append(list(tok))
    if truncated:
        logger.debug("left-truncated %d of %d prompts to %s tokens", truncated, len(prompts), max_prompt_length)
    return TokenizedPrompts(texts, ids, truncated)


def pretokenized_prompts(rows: Sequence[dict], tokenizer: Any, max_prompt_length: int | None) -> TokenizedPrompts:
    """Prompts given as an `input_ids` column (TRL's PPO datasets): padding dropped, left-truncated;
    the decoded text stands in for the prompt where reward functions need one."""
    pad = tokenizer.pad_token_id
    texts, ids, truncated = [], [], 0
    for i, row in enumerate(rows):
        tok = [int(t) for t in row["input_ids"] if pad is None or int(t) != pad]
        if not tok:
            raise ValueError(f"prompt {i} has no tokens in its input_ids (after removing padding).")
        if max_prompt_length is not None and len(tok) > max_prompt_length:
            tok, truncated = tok[-max_prompt_length:], truncated + 1
        texts.append(tokenizer.decode(tok, skip_special_tokens=True))
        ids.append(tok)
    return TokenizedPrompts(texts, ids, truncated)


def ensure_pad_token(tokenizer: Any) -> None:
    """Give a tokenizer without a pad token its EOS token as pad (logged), else raise."""
    if tokenizer.pad_token_id is not None:
        return
    if tokenizer.eos_token is None:
        raise ValueError("the tokenizer has neither a pad token nor an EOS token; set tokenizer.pad_token.")
    tokenizer.pad_token = tokenizer.eos_token
    logger.info("tokenizer has no pad token; using its EOS token %r for padding", tokenizer.eos_token)
