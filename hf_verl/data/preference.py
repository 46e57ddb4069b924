"""Preference data for DPO and reward modelling: prompt extraction, rendering, tokenisation, truncation, batching.

Rows hold `prompt`/`chosen`/`rejected` (explicit prompt) or `chosen`/`rejected` only (implicit
prompt: their shared prefix is the prompt), as text (standard) or as lists of chat messages
(conversational). Conversational rows may carry `tools` (a list, or its JSON text) and
`chat_template_kwargs` (a dict), handed to the chat template row by row, as TRL does.
:func:`render_pair` turns a row into the texts both trainers tokenise (the prompt, and prompt + each
answer: the chat template's rendering, or the text with an EOS appended).

DPO tokenises each row into `prompt_ids`, `chosen_ids`, `rejected_ids` (:func:`tokenize_pair`); a reward
model scores whole sequences, so its rows become `chosen_ids` / `rejected_ids` holding prompt and answer
together (:func:`tokenize_sequences`). A batch of pairs becomes one tensor batch of `2B` sequences, chosen
rows first, either right-padded or packed without padding (position ids restart at each sequence), by
:class:`PreferenceCollator` (a plain object, so that dataloader workers can receive it), which also carries
a reward dataset's per-pair `margin`.
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
MARGIN_COLUMN = "margin"  # a reward dataset's per-pair margin (RewardTrainer)
TRUNCATION_MODES = ("keep_start", "keep_end")


def check_preference_columns(columns: Sequence[str], needs: str = "DPO needs 'chosen' and 'rejected' (and "
                             "optionally 'prompt').") -> None:
    """Raise naming the missing columns and listing those present; `needs` ends the message (what the trainer
    reads)."""
    missing = [c for c in PAIR_COLUMNS if c not in columns]
    if missing:
        raise ValueError(f"preference dataset is missing column(s) {missing}; columns present: {list(columns)}. "
                         f"{needs}")


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


@dataclass
class RenderedPair:
    """A preference row as the texts to tokenise: the prompt alone (with the chat template's generation prompt),
    and prompt + chosen, prompt + rejected (`add_special_tokens`: whether the tokenizer adds its own, as for plain
    text; a chat template writes them itself)."""

    prompt: str
    chosen: str
    rejected: str
    add_special_tokens: bool


def render_pair(row: dict, tokenizer, index: int = 0, *, require_answers: bool = True) -> RenderedPair:
    """Render one preference row (see the module docstring).

    Args:
        row (`dict`): `chosen` / `rejected`, optionally `prompt`, `tools`, `chat_template_kwargs`.
        tokenizer: its chat template renders conversational rows; its EOS ends text answers.
        index (`int`): the row's index, for errors.
        require_answers (`bool`): refuse an answer that is empty once the prompt is split off (DPO scores the
            answers' tokens; a reward model scores the whole sequence and accepts it).
    """
    chosen, rejected = row["chosen"], row["rejected"]
    if "prompt" in row and row["prompt"] is not None:
        prompt = row["prompt"]
    else:
        prompt, chosen, rejected = extract_prompt(chosen, rejected)
    for name, value in (("chosen", chosen), ("rejected", rejected)):
        if value is None or (require_answers and (len(value) == 0 or (isinstance(value, str) and not value.strip()))):
            raise ValueError(f"row {index}: {name!r} is empty; every pair needs a non-empty chosen and rejected.")
    conversational = is_conversational(prompt) if prompt else isinstance(chosen, list)
    if conversational:
        tools = row.get("tools")
        tools = json.loads(tools) if isinstance(tools, str) else tools
        template_kwargs = dict(row.get("chat_template_kwargs") or {})

        def render(messages, gen):
            return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=gen,
                                                 **template_kwargs)

        return RenderedPair(render(prompt, True), render(prompt + chosen, False), render(prompt + rejected, False),
                            add_special_tokens=False)
    eos = tokenizer.eos_token or ""
    return RenderedPair(prompt, prompt + chosen + ("" if chosen.endswith(eos) else eos),
                        prompt + rejected + ("" if rejected.endswith(eos) else eos), add_special_tokens=True)


def tokenize_pair(row: dict, tokenizer, max_length: int | None, truncation_mode: str = "keep_start",
                  index: int = 0) -> TokenizedPair:
    """Tokenise one preference row for DPO (see the module docstring); raise on empty completions."""
    if truncation_mode not in TRUNCATION_MODES:
        raise ValueError(f"truncation_mode must be one of {TRUNCATION_MODES}, got {truncation_mode!r}.")
    texts = render_pair(row, tokenizer, index)
    add_special = texts.add_special_tokens
    p = tokenizer(texts.prompt, add_special_tokens=add_special)["input_ids"] if texts.prompt else []
    pc = tokenizer(texts.chosen, add_special_tokens=add_special)["input_ids"]
    pr = tokenizer(texts.rejected, add_special_tokens=add_special)["input_ids"]
    # the completion starts where prompt and prompt+completion tokenisations diverge
    n = min(_common_prefix(p, pc), _common_prefix(p, pr))
    pair = TokenizedPair(list(p[:n]), list(pc[n:]), list(pr[n:]))
    pair.identical = pair.chosen_ids == pair.rejected_ids
    if max_length is not None:
        pair.truncated = _truncate(pair, max_length, truncation_mode)
    return pair


def tokenize_sequences(row: dict, tokenizer, index: int = 0) -> tuple[list[int], list[int]]:
    """The token ids of prompt + chosen and prompt + rejected, whole (a reward model's two sequences)."""
    texts = render_pair(row, tokenizer, index, require_answers=False)
    add_special = texts.add_special_tokens
    return (list(tokenizer(texts.chosen, add_special_tokens=add_special)["input_ids"]),
            list(tokenizer(texts.rejected, add_special_tokens=add_special)["input_ids"]))


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
    """Rows of `prompt_ids` / `chosen_ids` / `rejected_ids` (a row without `prompt_ids`, a reward model's, is whole
    sequences: empty prompt) to one batch of :func:`collate_pairs`; the per-row floats that ride along (DPO's
    precomputed `ref_chosen_logps` / `ref_rejected_logps`, a reward dataset's `margin`) as `(B,)` tensors."""

    pad_token_id: int
    padding_free: bool = False
    pad_to_multiple_of: int | None = None

    def __call__(self, rows: Sequence[dict]) -> dict:
        pairs = [TokenizedPair(list(r.get("prompt_ids") or []), list(r["chosen_ids"]), list(r["rejected_ids"]))
                 for r in rows]
        batch = collate_pairs(pairs, self.pad_token_id, self.padding_free, self.pad_to_multiple_of)
        for col in (*REF_COLUMNS, MARGIN_COLUMN):
            if col in rows[0]:
                batch[col] = torch.tensor([float(r[col]) for r in rows])
        return batch
