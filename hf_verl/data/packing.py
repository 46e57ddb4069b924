"""Padding-free packing of RL rows: many (prompt + completion) rows as one sequence, and back.

A rollout batch is padded twice (prompts on the left, completions on the right), so a batch of
rows of very different lengths spends most of its attention and MLP work on padding. Packing
concatenates the *real* tokens of every row into one sequence of shape ``(1, T)``:

- `position_ids` restart at 0 on every row, so rotary embeddings see each row as if alone;
- `cu_seqlens` (cumulative boundaries, flash-attention's varlen convention) and `segment_ids` (the
  row of every token) describe the block-diagonal causal mask: no token attends across rows;
- `labels` holds each token's *next token within its row*, taken from the global packed sequence
  before any sequence-parallel sharding, so that a shard's last token still gets its label (from
  the next shard) and a row's last token never gets the next row's first token;
- `loss_mask` marks the positions whose label is a scored completion token;
- the sequence is padded at the end (after the last row) to a multiple of `multiple_of`, the
  sequence-parallel degree: the padding is a segment of its own, never scored.

:func:`unpack_completion` maps any per-token output of the packed sequence (log-probs, entropy,
values, logits) back to the trainers' ``(rows, completion_len)`` layout, zero on padding.

A token is *real* when the row's attention mask says so (`prompt_mask`, then
`completion_attention_mask` or, when that is absent, `completion_mask`: exactly the tokens the
padded forward attends to). Masked-out tokens of the padded layout are dropped, which gives every
remaining token the same context and position as in the padded forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hf_verl.data.batch import RolloutBatch, pad_sequences


@dataclass
class PackedBatch:
    """Rows packed into one padding-free sequence (see the module docstring).

    Attributes:
        input_ids (`torch.LongTensor` `(1, T)`): the real tokens of every row, then the padding tail.
        position_ids (`torch.LongTensor` `(1, T)`): position within the row (the tail counts from 0 too).
        labels (`torch.LongTensor` `(1, T)`): the next token of the same row; 0 where there is none (a row's
            last token, the tail).
        loss_mask (`torch.BoolTensor` `(1, T)`): positions whose label is a scored completion token.
        segment_ids (`torch.LongTensor` `(T,)`): row of every token; the tail is segment `num_rows`.
        cu_seqlens (`torch.IntTensor` `(num_segments + 1,)`): segment boundaries, rows then the tail if
            any, ending at `T` (an empty row gives a repeated boundary).
        max_seqlen (`int`): the longest segment.
        num_rows (`int`): rows packed. num_tokens (`int`): their real tokens (`T` minus the tail).
        completion_index (`torch.LongTensor` `(B, C)`): for each completion token, the packed position
            that predicts it (0 where `completion_mask` is 0).
        completion_mask (`torch.BoolTensor` `(B, C)`): the completion tokens that are scored.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    segment_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    num_rows: int
    num_tokens: int
    completion_index: torch.Tensor
    completion_mask: torch.Tensor

    @property
    def length(self) -> int:
        """`T`: the packed length, padding tail included (a multiple of the packing's `multiple_of`)."""
        return self.input_ids.shape[1]

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """:func:`unpack_completion` of `values`."""
        return unpack_completion(self, values)


def pack_padded(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                completion_mask: torch.Tensor, *, completion_attention_mask: torch.Tensor | None = None,
                multiple_of: int = 1, pad_token_id: int = 0) -> PackedBatch:
    """Pack rows given in the rollout layout: prompts `(B, P)` left-padded, completions `(B, C)` right-padded.

    Args:
        prompt_ids / prompt_mask (`torch.Tensor` `(B, P)`): prompt tokens and their attention mask.
        completion_ids / completion_mask (`torch.Tensor` `(B, C)`): completion tokens and the mask of those
            scored (trained on).
        completion_attention_mask (`torch.Tensor` `(B, C)`, *optional*): the completion's attention mask when
            it attends tokens that are not scored (a multi-turn rollout's tool observations).
        multiple_of (`int`): the packed length is padded up to a multiple of it (the sequence-parallel degree).
        pad_token_id (`int`): the token id of the padding tail.

    Raises:
        ValueError: a scored completion token that is not attended, or one with no token before it in its row.
    """
    if multiple_of < 1:
        raise ValueError(f"multiple_of must be >= 1, got {multiple_of}.")
    B, P = prompt_ids.shape  # noqa: N806
    C = completion_ids.shape[1]  # noqa: N806
    device = prompt_ids.device
    scored_c = completion_mask.bool()
    attended_c = scored_c if completion_attention_mask is None else completion_attention_mask.bool()
    if (scored_c & ~attended_c).any():
        row = int((scored_c & ~attended_c).any(1).nonzero()[0])
        raise ValueError(f"row {row} scores a completion token its completion_attention_mask does not attend.")
    ids = torch.cat([prompt_ids, completion_ids], 1)
    real = torch.cat([prompt_mask.bool(), attended_c], 1)
    scored = torch.cat([torch.zeros_like(prompt_mask, dtype=torch.bool), scored_c], 1)

    lengths = real.sum(1)
    n = int(lengths.sum())
    flat_ids = ids[real]
    rows = torch.arange(B, device=device).unsqueeze(1).expand(B, P + C)[real]
    starts = torch.cumsum(lengths, 0) - lengths
    positions = torch.arange(n, device=device) - starts[rows]
    # the label of a token is the next token of the same row; it is scored when that token is
    flat_scored = scored[real]
    labels = torch.zeros(n, dtype=torch.long, device=device)
    loss_mask = torch.zeros(n, dtype=torch.bool, device=device)
    if n > 1:
        same_row = rows[1:] == rows[:-1]
        labels[:-1] = torch.where(same_row, flat_ids[1:].long(), 0)
        loss_mask[:-1] = same_row & flat_scored[1:]

    # where each completion token sits in the packed sequence, and so which position predicts it
    packed_pos = (real.flatten().long().cumsum(0) - 1).view(B, P + C)[:, P:]
    first_in_row = scored_c & (packed_pos == starts.unsqueeze(1))
    if first_in_row.any():
        row = int(first_in_row.any(1).nonzero()[0])
        raise ValueError(f"row {row} scores its first token: a scored completion token needs a token before it "
                         "(a non-empty prompt).")
    completion_index = torch.where(scored_c, packed_pos - 1, 0)

    total = max(-(-n // multiple_of) * multiple_of, multiple_of)
    tail = total - n
    boundaries = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])
    if tail:
        boundaries = torch.cat([boundaries, boundaries.new_tensor([total])])
    pad = torch.full((tail,), pad_token_id, dtype=torch.long, device=device)
    return PackedBatch(
        input_ids=torch.cat([flat_ids.long(), pad]).unsqueeze(0),
        position_ids=torch.cat([positions, torch.arange(tail, device=device)]).unsqueeze(0),
        labels=torch.cat([labels, torch.zeros_like(pad)]).unsqueeze(0),
        loss_mask=torch.cat([loss_mask, torch.zeros(tail, dtype=torch.bool, device=device)]).unsqueeze(0),
        segment_ids=torch.cat([rows, torch.full((tail,), B, dtype=torch.long, device=device)]),
        cu_seqlens=boundaries.to(torch.int32),
        max_seqlen=int(max(int(lengths.max()) if B else 0, tail)),
        num_rows=B,
        num_tokens=n,
        completion_index=completion_index,
        completion_mask=scored_c,
    )


def pack_rollout(batch: RolloutBatch, *, multiple_of: int = 1, pad_token_id: int = 0) -> PackedBatch:
    """:func:`pack_padded` of a :class:`~hf_verl.data.batch.RolloutBatch` (tool observations attended, not scored)."""
    return pack_padded(batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask,
                       completion_attention_mask=batch.completion_attention_mask, multiple_of=multiple_of,
                       pad_token_id=pad_token_id)


def pack_rows(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
              loss_masks: Sequence[Sequence[int]] | None = None, *, multiple_of: int = 1,
              pad_token_id: int = 0) -> PackedBatch:
    """Pack ragged rows given as lists: `prompts[i] + completions[i]` is row `i`; `loss_masks[i]` (default all
    ones) says which completion tokens are scored; every completion token is attended."""
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions.")
    p_ids, p_mask = pad_sequences(prompts, pad_token_id, side="left")
    c_ids, c_mask = pad_sequences(completions, pad_token_id, side="right")
    attention = None
    if loss_masks is not None:
        if [len(m) for m in loss_masks] != [len(c) for c in completions]:
            raise ValueError("each loss mask must have its completion's length.")
        attention = c_mask
        c_mask, _ = pad_sequences(loss_masks, 0, side="right", width=c_ids.shape[1])
    return pack_padded(p_ids, p_mask, c_ids, c_mask, completion_attention_mask=attention,
                       multiple_of=multiple_of, pad_token_id=pad_token_id)


def unpack_completion(packed: PackedBatch, values: torch.Tensor) -> torch.Tensor:
    """Per-token outputs of the packed sequence in the rollout layout: `(B, C, ...)`, 0 where not scored.

    Args:
        packed ([`PackedBatch`]): the packing the outputs were computed on.
        values (`torch.Tensor` `(T, ...)` or `(1, T, ...)`): one entry per packed position, the position
            that *predicts* a token (as a causal LM's outputs are); autograd flows through.

    Returns:
        `torch.Tensor` `(B, C, ...)`: entry `(b, c)` is the output at the position predicting completion
        token `c` of row `b`.
    """
    T = packed.length  # noqa: N806
    if values.shape[0] != T and values.dim() >= 2 and values.shape[0] == 1 and values.shape[1] == T:
        values = values[0]
    if values.shape[0] != T:
        raise ValueError(f"values have {values.shape[0]} positions, the packed sequence has {T}.")
    out = values[packed.completion_index]
    mask = packed.completion_mask.view(*packed.completion_mask.shape, *([1] * (values.dim() - 1)))
    return torch.where(mask, out, out.new_zeros(()))


def block_causal_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """`(1, 1, T, T)` bool: query `q` attends key `k` when `k <= q` and both are in the same segment."""
    T = segment_ids.shape[0]  # noqa: N806
    idx = torch.arange(T, device=segment_ids.device)
    same = segment_ids.unsqueeze(1) == segment_ids.unsqueeze(0)
    return (same & (idx.unsqueeze(1) >= idx.unsqueeze(0))).view(1, 1, T, T)
