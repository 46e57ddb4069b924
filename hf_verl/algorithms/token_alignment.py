"""Aligning one tokenisation's per-token log-probs to another's, by character offsets (pure functions).

A reference (or any scoring role) with another tokenizer than the actor scores the same text cut into other
tokens. Both tokenisations are described by the character position where each token *ends* in the completion
text (non-decreasing; a token that adds no text, such as EOS, ends where the previous one did).

**The rule.** A *common boundary* is a character position where a token of each tokenisation ends (and the end
of the text). The text between two consecutive common boundaries is a *segment*: the two tokenisations cut it
differently, but both spell it exactly, so the sum of a tokenisation's log-probs over a segment is the log-prob
of that text under it. Each segment's summed role log-prob goes to the *first actor token that reaches the
segment's end* (the actor token that ends at or after the role tokens' end). Then:

- an actor token made of several role tokens (a coarser actor) gets the sum of their log-probs;
- a role token spanning several actor tokens (a finer actor) is assigned to the last of them (the first one to
  reach its end); the other actor tokens of the segment get the actor's own log-prob when `actor_logprobs` is
  given (a KL term of 0 there) and the assigned one gets the rest, `role sum - actor's other log-probs`, so that
  the summed log-ratio `sum(ref - actor)` over every segment equals the role's minus the actor's log-prob of that
  text. Without `actor_logprobs` the others get 0 and are flagged in the returned mask;
- role tokens that straddle the start of the completion (begun in the prompt) belong to its first segment;
  role tokens after the last actor token's end belong to the last segment.

So k1 (`ref - actor`) summed over a segment is exact; per-token estimators (k2, k3) see the segment's log-ratio
on its last token, which is exact where each segment is one token of each (equal tokenisations) and otherwise a
documented approximation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def segment_ids(ends: Sequence[int], boundaries: Sequence[int]) -> list[int]:
    """For each token end, the index of the first boundary at or after it (the segment it belongs to); ends past
    the last boundary belong to the last segment."""
    out, b = [], 0
    for end in ends:
        while b < len(boundaries) - 1 and boundaries[b] < end:
            b += 1
        out.append(b)
    return out


def align_logprobs(actor_ends: Sequence[int], role_ends: Sequence[int], role_logprobs: torch.Tensor,
                   actor_logprobs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The role's log-probs on the actor's tokens, by the rule of the module docstring.

    Args:
        actor_ends (`Sequence[int]`): where each of the `C` actor tokens ends in the completion text (characters,
            non-decreasing).
        role_ends (`Sequence[int]`): where each of the `R` role tokens ends, in the same coordinates (a token
            begun in the prompt may end at a position <= 0: it joins the first segment).
        role_logprobs (`torch.Tensor` of shape `(R,)`): the role's log-prob of each of its tokens.
        actor_logprobs (`torch.Tensor` of shape `(C,)`, *optional*): the actor's log-probs, given to the actor
            tokens of a segment that do not receive its sum.

    Returns:
        `(aligned, assigned)`: `aligned` `(C,)` float32, and `assigned` `(C,)` bool, True on the actor tokens
        that received a segment's role log-prob.

    Raises:
        ValueError: lengths that disagree, or ends that decrease.
    """
    n_actor, n_role = len(actor_ends), len(role_ends)
    if role_logprobs.shape != (n_role,):
        raise ValueError(f"role_logprobs has shape {tuple(role_logprobs.shape)} for {n_role} role token ends")
    if actor_logprobs is not None and actor_logprobs.shape != (n_actor,):
        raise ValueError(f"actor_logprobs has shape {tuple(actor_logprobs.shape)} for {n_actor} actor token ends")
    for name, ends in (("actor_ends", actor_ends), ("role_ends", role_ends)):
        if any(b < a for a, b in zip(ends, ends[1:])):
            raise ValueError(f"{name} must be non-decreasing character positions, got {list(ends)[:20]}")
    aligned = torch.zeros(n_actor, dtype=torch.float32)
    assigned = torch.zeros(n_actor, dtype=torch.bool)
    if n_actor == 0:
        return aligned, assigned
    # common boundaries: ends shared by both tokenisations (past 0), and the actor text's end
    last = int(actor_ends[-1])
    boundaries = sorted({int(e) for e in actor_ends if e > 0} & {int(e) for e in role_ends} | {last})
    actor_seg = segment_ids(actor_ends, boundaries)
    role_seg = segment_ids(role_ends, boundaries)
    sums = torch.zeros(len(boundaries), dtype=torch.float64)
    sums.index_add_(0, torch.tensor(role_seg, dtype=torch.long), role_logprobs.double())
    # every boundary is an actor end: its segment's receiver is the first actor token ending exactly there
    receiver: dict[int, int] = {}
    for i, (seg, end) in enumerate(zip(actor_seg, actor_ends)):
        if seg not in receiver and end == boundaries[seg]:
            receiver[seg] = i
    for i in receiver.values():
        assigned[i] = True
    if actor_logprobs is None:
        for seg, i in receiver.items():
            aligned[i] = float(sums[seg])
        return aligned, assigned
    aligned = actor_logprobs.detach().float().cpu().clone()
    others = torch.zeros(len(boundaries), dtype=torch.float64)
    for i, seg in enumerate(actor_seg):
        if receiver[seg] != i:
            others[seg] += float(aligned[i])
    for seg, i in receiver.items():
        aligned[i] = float(sums[seg] - others[seg])
    return aligned, assigned
