"""A scoring role on another tokenizer than the actor's: same-tokenizer test, re-tokenisation, aligned log-probs.

Whether a role reads the actor's token ids is decided from the two tokenizers (:func:`same_tokenizer`: the same
vocabulary, token for id, and the same BOS / EOS / UNK and additional special tokens), never from embedding
sizes (a model may pad its embedding past its tokenizer). When they differ, :class:`CrossTokenizer` decodes the
actor's prompt and completion to text, re-tokenises `prompt text + completion text` with the role's tokenizer
(with character offsets), runs the role on its own ids, and aligns its per-token log-probs back to the actor's
completion tokens with :func:`~hf_verl.algorithms.token_alignment.align_logprobs` (the rule is in that module).

Departures and costs: the actor's special tokens inside the prompt (a chat template's markers) reach the role
as their text; special tokens in the completion (EOS) add no text, and an actor EOS is matched by the role's own
EOS, appended after the completion text. The alignment needs the actor's log-probs (for the actor tokens that
share a segment with others), so a cross-tokenizer reference costs one more actor forward per round.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hf_verl.algorithms.token_alignment import align_logprobs
from hf_verl.data.batch import RolloutBatch, pad_sequences


def same_tokenizer(a: Any, b: Any) -> bool:
    """Whether two tokenizers give every token id the same meaning: equal vocabularies (added tokens included)
    and equal BOS / EOS / UNK and additional special tokens. Padding is not compared (it is masked out)."""
    if a is b:
        return True

    def specials(tok):
        extra = getattr(tok, "additional_special_tokens", None) or []
        return (tok.bos_token, tok.eos_token, tok.unk_token, tuple(sorted(map(str, extra))))

    return a.get_vocab() == b.get_vocab() and specials(a) == specials(b)


def token_ends(tokenizer: Any, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> tuple[str, str, list[int]]:
    """`(prompt text, completion text, end of each completion token)`: where each token of `completion_ids` ends
    in the completion text, in characters. The prompt decodes with its special tokens; completion special tokens
    add no text (their end is the previous token's). A token that completes a multi-byte character later ends
    where that character ends (the ends are the running minimum from the right of the prefix lengths)."""
    special = set(tokenizer.all_special_ids)
    prompt_text = tokenizer.decode(list(prompt_ids), skip_special_tokens=False)
    lengths, kept = [], []
    for token in completion_ids:
        if token not in special:
            kept.append(int(token))
        text = tokenizer.decode(list(prompt_ids) + kept, skip_special_tokens=False)
        lengths.append(len(text) - len(prompt_text) if text.startswith(prompt_text) else len(text))
    full = tokenizer.decode(list(prompt_ids) + kept, skip_special_tokens=False)
    completion_text = full[len(prompt_text):] if full.startswith(prompt_text) else full
    ends, low = [0] * len(lengths), len(completion_text)
    for i in range(len(lengths) - 1, -1, -1):
        low = min(low, max(lengths[i], 0))
        ends[i] = low
    return prompt_text, completion_text, ends


def retokenize(tokenizer: Any, prompt_text: str, completion_text: str, *,
               append_eos: bool) -> tuple[list[int], list[int], list[int]]:
    """`(role prompt ids, role completion ids, end of each role completion token)` of `prompt_text +
    completion_text` under the role's `tokenizer` (its own special tokens added). A role token that ends inside
    the prompt is a prompt token; the rest (one straddling the boundary included) are completion tokens, their
    ends relative to the completion's start. With `append_eos`, the role's EOS closes the completion.

    Raises:
        ValueError: the role's tokens leave no prompt token to condition the completion on.
    """
    enc = tokenizer(prompt_text + completion_text, return_offsets_mapping=True, add_special_tokens=True)
    ids, offsets, cut = enc["input_ids"], enc["offset_mapping"], len(prompt_text)
    split = next((j for j, (_, end) in enumerate(offsets) if end > cut), len(ids))
    if split == 0:
        raise ValueError("the role's tokenizer puts the whole prompt into the completion's first token, so that "
                         "token has nothing to be conditioned on: give the role a tokenizer that adds a BOS token.")
    comp_ids, ends, last = list(ids[split:]), [], 0
    for _, end in offsets[split:]:
        last = max(last, end - cut)
        ends.append(last)
    if append_eos and tokenizer.eos_token_id is not None:
        comp_ids.append(tokenizer.eos_token_id)
        ends.append(len(completion_text))
    return list(ids[:split]), comp_ids, ends


class CrossTokenizer:
    """Scores a batch of the actor's rollouts with a role that has its own tokenizer (see the module docstring).

    Args:
        actor_tokenizer: the actor's tokenizer (decodes the rollout).
        role_tokenizer: the role's tokenizer (re-tokenises the text).
        role (`str`, defaults to `"reference"`): the role named in errors.
    """

    def __init__(self, actor_tokenizer: Any, role_tokenizer: Any, role: str = "reference") -> None:
        self.actor_tokenizer, self.role_tokenizer, self.role = actor_tokenizer, role_tokenizer, role

    def role_batch(self, batch: RolloutBatch) -> tuple[RolloutBatch, list[list[int]], list[list[int]]]:
        """`(the batch in the role's tokens, actor token ends per row, role token ends per row)`."""
        eos = self.actor_tokenizer.eos_token_id
        prompts, completions, actor_ends, role_ends = [], [], [], []
        for row in range(batch.batch_size):
            p_ids = batch.prompt_ids[row][batch.prompt_mask[row].bool()].tolist()
            c_ids = batch.completion_ids[row][batch.completion_mask[row].bool()].tolist()
            p_text, c_text, a_ends = token_ends(self.actor_tokenizer, p_ids, c_ids)
            try:
                rp, rc, r_ends = retokenize(self.role_tokenizer, p_text, c_text, append_eos=eos in c_ids)
            except ValueError as err:
                raise ValueError(f"{self.role} on another tokenizer, row {row} ({p_text[-40:]!r}): {err}") from None
            prompts.append(rp)
            completions.append(rc)
            actor_ends.append(a_ends)
            role_ends.append(r_ends)
        pad = self.role_tokenizer.pad_token_id
        pad = pad if pad is not None else (self.role_tokenizer.eos_token_id or 0)
        p_ids, p_mask = pad_sequences(prompts, pad, side="left", device=batch.device)
        width = max(1, max(len(c) for c in completions))  # all-empty completions still have one (masked) column
        c_ids, c_mask = pad_sequences(completions, pad, side="right", device=batch.device, width=width)
        return RolloutBatch(p_ids, p_mask, c_ids, c_mask), actor_ends, role_ends

    def align(self, role_logprobs: torch.Tensor, role_ends: list[list[int]], actor_ends: list[list[int]],
              actor_logprobs: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
        """`(B, C)` role log-probs on the actor's completion tokens (0 on padding)."""
        out = torch.zeros(completion_mask.shape, dtype=torch.float32)
        for row, (a_ends, r_ends) in enumerate(zip(actor_ends, role_ends)):
            cols = completion_mask[row].bool().nonzero().flatten().cpu()
            aligned, _ = align_logprobs(a_ends, r_ends, role_logprobs[row, : len(r_ends)].float().cpu(),
                                        actor_logprobs[row].float().cpu()[cols])
            out[row, cols] = aligned
        return out.to(completion_mask.device)

    def logprobs(self, role_engine: Any, actor_engine: Any, batch: RolloutBatch, *, temperature: float,
                 chunk_size: int, micro_batch: int) -> torch.Tensor:
        """The role's `(B, C)` log-probs of the actor's completion tokens, aligned by character offsets."""
        from hf_verl.engine.step import LogProbs

        request = LogProbs(temperature=temperature, chunk_size=chunk_size)
        role_batch, actor_ends, role_ends = self.role_batch(batch)
        role_batch = role_batch.to(role_engine.device) if role_engine.device != batch.device else role_batch
        role_lp = role_engine.infer(role_batch, request, micro_batch=micro_batch).logp
        actor_lp = actor_engine.infer(batch, request, micro_batch=micro_batch).logp
        return self.align(role_lp, role_ends, actor_ends, actor_lp, batch.completion_mask)
