"""Shared-prompt layout: the rows that continue one prompt scored in one sequence, the prompt computed once.

A GRPO group is `G` completions of one prompt and a DPO pair is two; the padded layout repeats the
prompt in every row, so its tokens go through every layer `G` (or 2) times in each forward and backward.
Here every distinct prompt becomes one row of the form ``prompt, completion_1, ..., completion_k``:

- `position_ids` run `0 .. p-1` over the prompt and restart at `p` for each completion, so every
  completion token has the position it has in its own padded row;
- a 4-D boolean `attention_mask` lets each completion token attend to the prompt and to the earlier
  tokens of its own completion only, so it sees exactly the context of its padded row: the outputs equal the
  padded layout's to float rounding, and the prompt's activations receive the sum of the gradients of all its
  completions, as the repeated rows' would;
- `index` gives, for every scored completion token (rows in order, then tokens in order: the order of
  `completion_mask[completion_mask]`), the flat position (into `rows x width`) whose output predicts it.
  A completion's first token is predicted by the prompt's last position, so that position appears once
  per completion.

The mask is dense (`rows x width x width`), so the layout suits the sdpa attention (a bool mask is
"attend") on sequences of moderate width; :func:`sharing_cost` is the arithmetic the engine uses to
decide when it pays against the padded or packed layouts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAX_MASK_ELEMENTS = 1 << 26  # 64 Mi booleans per forward: beyond it the dense mask itself is the problem


@dataclass
class SharedPrefixBatch:
    """Rows regrouped by prompt (see the module docstring).

    Attributes:
        input_ids (`torch.LongTensor` `(R, W)`): one row per distinct prompt.
        position_ids (`torch.LongTensor` `(R, W)`).
        attention_mask (`torch.BoolTensor` `(R, 1, W, W)`): True where a query position attends to a key position.
        index (`torch.LongTensor` `(N,)`): flat position (into `R * W`) predicting each scored token.
        targets (`torch.LongTensor` `(N,)`): the scored tokens.
        row_of (`torch.LongTensor` `(N,)`): the input row of each scored token.
        num_rows (`int`): input rows. tokens (`int`): real tokens laid out (prompts once).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    index: torch.Tensor
    targets: torch.Tensor
    row_of: torch.Tensor
    num_rows: int
    tokens: int

    @property
    def width(self) -> int:
        return self.input_ids.shape[1]

    def to(self, device: torch.device) -> SharedPrefixBatch:
        return SharedPrefixBatch(self.input_ids.to(device), self.position_ids.to(device),
                                 self.attention_mask.to(device), self.index.to(device), self.targets.to(device),
                                 self.row_of.to(device), self.num_rows, self.tokens)


def group_by_prompt(prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    """Indices of the rows of each distinct prompt, in order of first appearance."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, prompt in enumerate(prompts):
        groups.setdefault(tuple(prompt), []).append(i)
    return list(groups.values())


def share_prefixes(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], *,
                   pad_token_id: int = 0) -> SharedPrefixBatch | None:
    """Lay out `prompts[i] + completions[i]` rows with each distinct prompt once.

    Every completion token is scored. Returns `None` when no two rows share a prompt (nothing to gain) or a prompt
    is empty (its first completion token would have no position to be predicted from).
    """
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions.")
    if not prompts or any(len(p) == 0 for p in prompts):
        return None
    groups = group_by_prompt(prompts)
    if len(groups) == len(prompts):
        return None
    widths = [len(prompts[g[0]]) + sum(len(completions[i]) for i in g) for g in groups]
    rows, width = len(groups), max(widths)
    input_ids = torch.full((rows, width), pad_token_id, dtype=torch.long)
    position_ids = torch.zeros((rows, width), dtype=torch.long)
    segment = torch.full((rows, width), -1, dtype=torch.long)  # 0: the prompt, k >= 1: completion k, -1: padding
    where: list[tuple[int, int]] = [(0, 0)] * len(prompts)  # input row -> (layout row, start of its completion)
    for r, group in enumerate(groups):
        prompt = prompts[group[0]]
        p = len(prompt)
        input_ids[r, :p] = torch.tensor(prompt, dtype=torch.long)
        position_ids[r, :p] = torch.arange(p)
        segment[r, :p] = 0
        start = p
        for k, i in enumerate(group, start=1):
            n = len(completions[i])
            if n:
                input_ids[r, start:start + n] = torch.tensor(completions[i], dtype=torch.long)
                position_ids[r, start:start + n] = torch.arange(p, p + n)
                segment[r, start:start + n] = k
            where[i] = (r, start)
            start += n
    query, key = segment[:, :, None], segment[:, None, :]
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    mask = causal & (query >= 0) & ((key == 0) | (key == query))
    mask |= torch.eye(width, dtype=torch.bool)  # padding attends to itself: no all-masked row (NaN) in sdpa
    index, targets, row_of = [], [], []
    for i, completion in enumerate(completions):
        r, start = where[i]
        n = len(completion)
        if not n:
            continue
        p = len(prompts[i])
        positions = [p - 1, *range(start, start + n - 1)]  # the prompt's last token predicts the first one
        index.extend(r * width + q for q in positions)
        targets.extend(completion)
        row_of.extend([i] * n)
    return SharedPrefixBatch(input_ids, position_ids, mask[:, None], torch.tensor(index, dtype=torch.long),
                             torch.tensor(targets, dtype=torch.long), torch.tensor(row_of, dtype=torch.long),
                             len(prompts), int(sum(widths)))


def layer_cost(tokens: float, attended_pairs: float, *, hidden_size: int, intermediate_size: int,
               kv_fraction: float = 1.0) -> float:
    """Multiply-adds of one decoder layer, up to a common factor: `tokens` through the projections and MLP, and
    `attended_pairs` (query, key) pairs computed by attention."""
    per_token = hidden_size * (2 + 2 * kv_fraction) + 3 * intermediate_size  # q, o, k, v projections; gated MLP
    return tokens * per_token + 2 * attended_pairs


def sharing_cost(layout: SharedPrefixBatch, **model: float) -> float:
    """:func:`layer_cost` of `layout`: its tokens, and every (query, key) pair of its dense-masked attention."""
    rows, width = layout.input_ids.shape
    return layer_cost(rows * width, rows * width * width, **model)


def padded_cost(rows: int, width: int, **model: float) -> float:
    """:func:`layer_cost` of a padded batch (a masked kernel computes every pair of a row)."""
    return layer_cost(rows * width, rows * width * width, **model)


def packed_cost(lengths: Sequence[int], **model: float) -> float:
    """:func:`layer_cost` of rows packed padding-free (per-row causal attention: half of each square)."""
    return layer_cost(sum(lengths), sum(n * n for n in lengths) / 2, **model)
