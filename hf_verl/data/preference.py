"""Preference data for DPO: prompt extraction, tokenisation, truncation, batching.

Rows hold `prompt`/`chosen`/`rejected` (explicit prompt) or `chosen`/`rejected` only (implicit
prompt: their shared prefix is the prompt), as text (standard) or as lists of chat messages
(conversational). Conversational rows may carry `tools` (a list, or its JSON text) and
`chat_template_kwargs` (a dict), handed to the chat template row by row, as TRL does. Each row
becomes `prompt_ids`, `chosen_ids`, `rejected_ids`; a batch of pairs becomes one tensor batch of
`2B` sequences, chosen rows first, either right-padded or packed without padding (position ids
restart at each sequence), by :class:`PreferenceCollator` (a plain object, so that dataloader
workers can receive it).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hf_verl.data.prompts import is_conversational

logger = logging.getLogger(__name__)

PAIR_COLUMNS = ("chosen", "rejected")
REF_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")
TRUNCATION_MODES = ("keep_start", "keep_end")


def check_preference_columns(columns: Sequence[str]) -> None:
    """Raise naming the missing columns and listing those present."""
    missing = [c for c in PAIR_COLUMNS if c not in columns]
    if missing:
        raise ValueError(
            f"preference dataset is missing column(s) {missing}; columns present: {list(columns)}. "
            "DPO needs 'chosen' and 'rejected' (and optionally 'prompt')."
        )


def extract_prompt(chosen: Any, rejected: Any) -> tuple[Any, Any, Any]:
    """Split an implicit-prompt pair into (prompt, chosen, rejected) at their shared prefix.

    Conversational pairs split at the first differing message; text pairs at the first differing
    character, moved back to the start of a whitespace run so the completions keep their space.
    """
    if isinstance(chosen, list):
        k = 0
        while k < min(len(chosen), len(rejected)) and chosen[k] == rejected[k]:
            k += 1
        return chosen[:k], chosen[k:], rejected[k:]
    k = 0
    while k < min(len(chosen), len(rejected)) and chosen[k] == rejected[k]:
        k += 1
    while k > 0 and chosen[k - 1].isspace():
        k -= 1
    return chosen[:k], chosen[k:], rejected[k:]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@dataclass
class TokenizedPair:
    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    truncated: bool = False
    identical: bool = False


def tokenize_pair(row: dict, tokenizer, max_length: int | None, truncation_mode: str = "keep_start",
                  index: int = 0) -> TokenizedPair:
    """Tokenise one preference row (see the module docstring); raise on empty completions."""
    if truncation_mode not in TRUNCATION_MODES:
        raise ValueError(f"truncation_mode must be one of {TRUNCATION_MODES}, got {truncation_mode!r}.")
    chosen, rejected = row["chosen"], row["rejected"]
    if "prompt" in row and row["prompt"] is not None:
        prompt = row["prompt"]
    else:
        prompt, chosen, rejected = extract_prompt(chosen, rejected)
    for name, value in (("chosen", chosen), ("rejected", rejected)):
        if value is None or len(value) == 0 or (isinstance(value, str) and not value.strip()):
            raise ValueError(f"row {index}: {name!r} is empty; every pair needs a non-empty chosen and rejected.")
    conversational = is_conversational(prompt) if prompt else isinstance(chosen, list)
    if conversational:
        tools = row.get("tools")
        tools = json.loads(tools) if isinstance(tools, str) else tools
        template_kwargs = dict(row.get("chat_template_kwargs") or {})

        def render(messages, gen):
            return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=gen,
                                                 **template_kwargs)

        prompt_text = render(prompt, True)
        chosen_full, rejected_full = render(prompt + chosen, False), render(prompt + rejected, False)
        add_special = False
    else:
        eos = tokenizer.eos_token or ""
        prompt_text = prompt
        chosen_full = prompt + chosen + ("" if chosen.endswith(eos) else eos)
        rejected_full = prompt + rejected + ("" if rejected.endswith(eos) else eos)
        add_special = True
    p = tokenizer(prompt_text, add_special_tokens=add_special)["input_ids"] if prompt_text else []
    pc = tokenizer(chosen_full, add_special_tokens=add_special)["input_ids"]
    pr = tokenizer(rejected_full, add_special_tokens=add_special)["input_ids"]
    # the completion starts where prompt and prompt+completion tokenisations diverge
    n = min(_common_prefix(p, pc), _common_prefix(p, pr))
    pair = TokenizedPair(list(p[:n]), list(pc[n:]), list(pr[n:]))
    pair.identical = pair.chosen_ids == pair.rejected_ids
    if max_length is not None:
        pair.truncated = _truncate(pair, max_length, truncation_mode)
    return pair


def _truncate(pair: TokenizedPair, max_length: int, mode: str) -> bool:
    longest = len(pair.prompt_ids) + max(len(pair.chosen_ids), len(pair.rejected_ids))
    if longest <= max_length:
        return False
    if mode == "keep_start":  # drop the ends of the completions
        room = max_length - len(pair.prompt_ids)
        pair.chosen_ids, pair.rejected_ids = pair.chosen_ids[:room], pair.rejected_ids[:room]
    else:  # keep_end: drop the start of the prompt
        room = max_length - max(len(pair.chosen_ids), len(pair.rejected_ids))
        pair.prompt_ids = pair.prompt_ids[-room:] if room > 0 else []
        if room < 0:  # a completion alone is too long: keep its end
            pair.chosen_ids, pair.rejected_ids = pair.chosen_ids[-max_length:], pair.rejected_ids[-max_length:]
    return True


def collate_pairs(pairs: Sequence[TokenizedPair], pad_token_id: int, padding_free: bool = False,
                  pad_to_multiple_of: int | None = None) -> dict:
    """One batch of `2B` sequences (chosen rows first).

    Padded: `input_ids`, `attention_mask`, `completion_mask` of shape `(2B, L)`, right-padded.
    Padding-free: `input_ids`, `position_ids`, `completion_mask`, `seq_index` of shape `(1, T)`
    with the sequences packed back to back (`seq_index` says which sequence a token belongs to; -1 on
    padding). `pad_to_multiple_of` rounds `L` / `T` up (masks 0 on the added positions).
    """
    seqs, comp = [], []
    for side in ("chosen_ids", "rejected_ids"):
        for p in pairs:
            c = getattr(p, side)
            seqs.append(p.prompt_ids + c)
            comp.append([0] * len(p.prompt_ids) + [1] * len(c))
    multiple = pad_to_multiple_of or 1
    if padding_free:
        total = sum(len(s) for s in seqs)
        extra = -total % multiple
        ids = torch.tensor([t for s in seqs for t in s] + [pad_token_id] * extra, dtype=torch.long).unsqueeze(0)
        pos = torch.tensor([i for s in seqs for i in range(len(s))] + list(range(extra)), dtype=torch.long).unsqueeze(0)
        mask = torch.tensor([m for c in comp for m in c] + [0] * extra, dtype=torch.long).unsqueeze(0)
        index = torch.tensor([k for k, s in enumerate(seqs) for _ in s] + [-1] * extra, dtype=torch.long).unsqueeze(0)
        return {"input_ids": ids, "position_ids": pos, "completion_mask": mask, "seq_index": index,
                "num_sequences": len(seqs)}
    width = max(len(s) for s in seqs)
    width += -width % multiple
    ids = torch.full((len(seqs), width), pad_token_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    cmask = torch.zeros((len(seqs), width), dtype=torch.long)
    for r, (s, c) in enumerate(zip(seqs, comp)):
        ids[r, : len(s)] = torch.tensor(s, dtype=torch.long)
        attn[r, : len(s)] = 1
        cmask[r, : len(c)] = torch.tensor(c, dtype=torch.long)
    return {"input_ids": ids, "attention_mask": attn, "completion_mask": cmask, "num_sequences": len(seqs)}


@dataclass
class PreferenceCollator:
    """Rows of `prompt_ids` / `chosen_ids` / `rejected_ids` (and, when precomputed, `ref_chosen_logps` /
    `ref_rejected_logps`) to one batch of :func:`collate_pairs`, the reference log-probs as `(B,)` tensors."""

    pad_token_id: int
    padding_free: bool = False
    pad_to_multiple_of: int | None = None

    def __call__(self, rows: Sequence[dict]) -> dict:
        pairs = [TokenizedPair(list(r["prompt_ids"]), list(r["chosen_ids"]), list(r["rejected_ids"])) for r in rows]
        batch = collate_pairs(pairs, self.pad_token_id, self.padding_free, self.pad_to_multiple_of)
        if REF_COLUMNS[0] in rows[0]:
            for col in REF_COLUMNS:
                batch[col] = torch.tensor([float(r[col]) for r in rows])
        return batch
