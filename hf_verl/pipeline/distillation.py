"""`GKDAlgorithm`: on-policy distillation (GKD, Agarwal et al., 2024) as one algorithm object.

What a front-end hands it is a :class:`~hf_verl.data.batch.RolloutBatch` of prompts and completions (the student's
own samples, a dataset's completions, or the teacher's) and whether the student sampled them; it returns the
micro-batch with the teacher's side attached (:meth:`GKDAlgorithm.prepare`), the student's forward request
(:meth:`GKDAlgorithm.forward_request`) and the loss function handed to the student engine's `forward_backward`
(:meth:`GKDAlgorithm.loss_fn`). Two modes, chosen at construction:

- **full distributions** (a local teacher with the student's tokenizer): the teacher's and the student's logits on
  each completion token, and the generalized JSD between them (:func:`~hf_verl.algorithms.distillation.
  generalized_jsd`, `beta`), TRL's GKD loss;
- **sampled tokens** (a teacher with another tokenizer, GOLD's setting, or a teacher served by URL, which returns
  the log-probs of given tokens only): the teacher's log-prob of each completion token, aligned to the student's
  tokens by text (:class:`~hf_verl.pipeline.cross_tokenizer.CrossTokenizer`), and the sampled-token loss
  (:func:`~hf_verl.algorithms.distillation.sampled_token_distillation_loss`); on the student's own samples the loss's
  value is the sampled reverse-KL estimate `mean(log p_S - log p_T)` (what is logged) and its gradient the
  surrogate's.

Every loss is a sum over completion tokens divided by the step's token count (over the accumulation window and the
data-parallel ranks: TRL's `num_items_in_batch` normalisation), computed by the front-end before the step.

Distillation is a family of its own, not a subclass of the RL families' :class:`~hf_verl.pipeline.algorithm.
Algorithm` (no rewards, advantages or reference): its teacher is a scoring role built by the role builder like the
reference (colocated, on its own placement, or served by URL).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hf_verl.algorithms.distillation import (
    generalized_jsd,
    sampled_token_distillation_loss,
)
from hf_verl.algorithms.token_alignment import align_logprobs
from hf_verl.data.batch import RolloutBatch, pad_sequences
from hf_verl.engine.step import LogProbs
from hf_verl.pipeline.cross_tokenizer import CrossTokenizer, same_tokenizer

IGNORE_INDEX = -100
UNSCORABLE_LOGPROB = -20.0
"""The teacher log-prob given to a student completion token that adds no text (a special token other than EOS:
padding, UNK, a chat marker): a teacher of another tokenizer cannot produce it (its probability is 0; this floor keeps
the estimate finite), and the student's tokens after it are not scored (their text has no place to align to)."""


# ----------------------------------------------------------------------------------------------- batch layouts
def batch_from_labels(input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor, pad: int,
                      ignore_index: int = IGNORE_INDEX) -> RolloutBatch:
    """A `(input_ids, attention_mask, labels)` batch (TRL's GKD layout, any padding side) as a `RolloutBatch`: per
    row, the attended tokens before the first counted label are the prompt, the attended tokens from there on the
    completion (its mask is 1 where the label counts).

    Raises:
        ValueError: a row with no prompt token (nothing to condition the first completion token on).
    """
    prompts, completions, masks = [], [], []
    for row in range(input_ids.shape[0]):
        keep = attention_mask[row].bool()
        ids, lab = input_ids[row][keep].tolist(), labels[row][keep].tolist()
        first = next((i for i, t in enumerate(lab) if t != ignore_index), len(lab))
        if first == 0:
            raise ValueError(f"row {row} has a label on its first token: a completion needs at least one prompt token "
                             "before it (labels are -100 on the prompt).")
        prompts.append(ids[:first])
        completions.append(ids[first:])
        masks.append([int(t != ignore_index) for t in lab[first:]])
    device = input_ids.device
    p_ids, p_mask = pad_sequences(prompts, pad, side="left", device=device)
    width = max(1, max(len(c) for c in completions))
    c_ids, c_attn = pad_sequences(completions, pad, side="right", device=device, width=width)
    c_mask, _ = pad_sequences(masks, 0, side="right", device=device, width=width)
    batch = RolloutBatch(p_ids, p_mask, c_ids, c_mask)
    batch.completion_attention_mask = c_attn
    return batch


def labels_from_batch(batch: RolloutBatch, ignore_index: int = IGNORE_INDEX) -> dict[str, torch.Tensor]:
    """`input_ids`, `attention_mask` and `labels` of a `RolloutBatch` (prompt then completion; -100 on the prompt
    and wherever the completion mask is 0)."""
    attn = batch.completion_attention_mask if batch.completion_attention_mask is not None else batch.completion_mask
    input_ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)
    attention_mask = torch.cat([batch.prompt_mask, attn], dim=1)
    labels = input_ids.clone()
    labels[:, : batch.prompt_ids.shape[1]] = ignore_index
    labels[:, batch.prompt_ids.shape[1]:][batch.completion_mask == 0] = ignore_index
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def completion_masks(sequences: torch.Tensor, prompt_mask: torch.Tensor, eos_token_id: Any
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """`(attention_mask, labels)` of generated `sequences` (the prompt's `P` columns, then the completion), as TRL's
    `generate_on_policy_outputs` builds them: the completion is kept up to and including its first stop token (any
    of `eos_token_id`, an id or a list; all of it when None), the prompt's attention is `prompt_mask`, and the
    labels are -100 on the prompt and after the stop."""
    width = prompt_mask.shape[1]
    completion = sequences[:, width:]
    device = sequences.device
    if eos_token_id is None:
        keep = torch.ones_like(completion)
    else:
        is_eos = torch.isin(completion, torch.as_tensor(eos_token_id, device=device))
        first = torch.full((is_eos.size(0),), is_eos.size(1), dtype=torch.long, device=device)
        stops = is_eos.any(dim=1)
        first[stops] = is_eos.int().argmax(dim=1)[stops]
        keep = (torch.arange(is_eos.size(1), device=device).expand(is_eos.size(0), -1) <= first.unsqueeze(1)).int()
    attention_mask = torch.ones_like(sequences)
    attention_mask[:, width:] = keep
    attention_mask[:, :width] = prompt_mask
    labels = sequences.clone()
    labels[attention_mask == 0] = IGNORE_INDEX
    labels[:, :width] = IGNORE_INDEX
    return attention_mask, labels


# ----------------------------------------------------------------------------------------------- requests
@dataclass(frozen=True)
class CompletionLogits:
    """A model's `(B, C, V)` logits predicting each completion token of a `RolloutBatch` (through the engine's own
    forward, :meth:`~hf_verl.engine.accelerate_engine.AccelerateEngine.forward`; only the completion's positions
    leave the head). Position ids count the attended tokens, so left padding does not shift them."""

    def run(self, engine: Any, batch: RolloutBatch) -> torch.Tensor:
        attn = batch.completion_attention_mask if batch.completion_attention_mask is not None else \
            batch.completion_mask
        input_ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)
        mask = torch.cat([batch.prompt_mask, attn], dim=1)
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        width = batch.completion_ids.shape[1]
        out = engine.forward(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=False,
                             logits_to_keep=width + 1)
        return out.logits[:, :-1].float()


@dataclass
class DistillBatch:
    """One micro-batch of distillation: the rollout, the teacher's side (`(B, C, V)` logits in the full mode,
    `(B, C)` aligned log-probs in the sampled one), whether the student sampled it, and the step's token count."""

    batch: RolloutBatch
    teacher: torch.Tensor
    on_policy: bool
    num_items: float = 1.0

    @property
    def batch_size(self) -> int:
        return self.batch.batch_size


@dataclass(frozen=True)
class StudentForward:
    """The student's forward on a :class:`DistillBatch`: full completion logits, or the completion tokens'
    log-probs (the engine's chunked head; no vocabulary-sized output) in the sampled mode."""

    full: bool

    def run(self, engine: Any, micro_batch: DistillBatch) -> torch.Tensor:
        if self.full:
            return CompletionLogits().run(engine, micro_batch.batch)
        return engine.logprobs(micro_batch.batch, temperature=1.0)[0]


# ----------------------------------------------------------------------------------------------- the algorithm
def check_round_trip(tokenizer: Any, texts: Sequence[str], role: str = "teacher") -> None:
    """Refuse a tokenizer that cannot carry the text between tokenizers: a slow tokenizer (no character offsets)
    or one whose `decode(encode(text))` is not `text` for a sample of the run's texts.

    Raises:
        ValueError: naming the text that did not come back and what to change.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"the {role}'s tokenizer ({type(tokenizer).__name__}) gives no character offsets (a slow "
                         "tokenizer): cross-tokenizer distillation aligns tokens by text; load its fast tokenizer "
                         "(AutoTokenizer.from_pretrained(..., use_fast=True)).")
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        back = tokenizer.decode(ids, skip_special_tokens=False)
        if back != text:
            raise ValueError(f"the {role}'s tokenizer cannot round-trip the run's text: {text[:60]!r} comes back as "
                             f"{back[:60]!r} (unknown characters, normalisation or added spaces), so its log-probs "
                             "cannot be aligned to the student's tokens: use a teacher whose tokenizer covers the "
                             "text (byte-level BPE does), or one with the student's tokenizer.")


class GKDAlgorithm:
    """On-policy distillation (see the module docstring).

    Args:
        config: the front-end's config (`beta` read live).
        teacher: the teacher's scoring role (a frozen engine, or a :class:`~hf_verl.engine.remote_reference.
            RemoteReference` for a served teacher).
        student_tokenizer: the student's tokenizer.
        teacher_tokenizer (*optional*): the teacher's, when it may differ from the student's.
        served (`bool`): the teacher is behind a URL (sampled tokens only).
        probe_texts (`Sequence[str]`): texts of the run the teacher's tokenizer must round-trip (cross-tokenizer).
    """

    name = "gkd"

    def __init__(self, config: Any, teacher: Any, *, student_tokenizer: Any, teacher_tokenizer: Any = None,
                 served: bool = False, probe_texts: Sequence[str] = ()) -> None:
        self.config, self.teacher = config, teacher
        self.cross = None
        if teacher_tokenizer is not None and not same_tokenizer(student_tokenizer, teacher_tokenizer):
            check_round_trip(teacher_tokenizer, probe_texts)
            self.cross = CrossTokenizer(student_tokenizer, teacher_tokenizer, role="teacher")
        self.sampled = self.cross is not None or served

    @property
    def mode(self) -> str:
        """`"cross_tokenizer"`, `"sampled"` (a served teacher, same tokenizer) or `"full"`."""
        return "cross_tokenizer" if self.cross is not None else "sampled" if self.sampled else "full"

    def forward_request(self) -> StudentForward:
        return StudentForward(full=not self.sampled)

    @torch.no_grad()
    def teacher_side(self, batch: RolloutBatch, student: Any, *, micro_batch: int | None = None) -> torch.Tensor:
        """The teacher's `(B, C, V)` logits (full mode) or `(B, C)` log-probs of the completion tokens, on
        `batch.device`."""
        device = getattr(self.teacher, "device", batch.device)
        if self.cross is not None:
            out = self._aligned(batch, student, micro_batch=micro_batch or batch.batch_size)
        else:
            moved = batch.to(device) if torch.device(device) != batch.device else batch
            out = self.teacher.infer(moved, LogProbs() if self.sampled else CompletionLogits(),
                                     micro_batch=micro_batch)
            out = out.logp if self.sampled else out
        return out.to(batch.device)

    def _aligned(self, batch: RolloutBatch, student: Any, *, micro_batch: int) -> torch.Tensor:
        """The teacher's `(B, C)` log-probs of the student's completion tokens across tokenizers: the text aligned
        by character offsets (:func:`~hf_verl.algorithms.token_alignment.align_logprobs`), and a completion's final
        EOS matched to the teacher's own EOS (the alignment's rule for the KL to a reference puts an EOS, which adds
        no text, into the previous token's segment: per token, EOS would cost the student nothing)."""
        role_batch, actor_ends, role_ends = self.cross.role_batch(batch)
        device = getattr(self.teacher, "device", batch.device)
        role_batch = role_batch.to(device) if torch.device(device) != batch.device else role_batch
        request = LogProbs(temperature=1.0)
        role_lp = self.teacher.infer(role_batch, request, micro_batch=micro_batch).logp.float().cpu()
        actor_lp = student.infer(batch, request, micro_batch=micro_batch).logp.float().cpu()
        student_eos, teacher_eos = self.cross.actor_tokenizer.eos_token_id, self.cross.role_tokenizer.eos_token_id
        out = torch.zeros(batch.completion_mask.shape, dtype=torch.float32)
        for row, (a_ends, r_ends) in enumerate(zip(actor_ends, role_ends)):
            cols = batch.completion_mask[row].bool().nonzero().flatten().cpu()
            r_lp = role_lp[row, : len(r_ends)]
            r_ids = role_batch.completion_ids[row][role_batch.completion_mask[row].bool()].tolist()
            if len(cols) and int(batch.completion_ids[row, cols[-1]]) == student_eos and r_ids and \
                    r_ids[-1] == teacher_eos:
                out[row, cols[-1]] = r_lp[-1]
                cols, a_ends, r_ends, r_lp = cols[:-1], a_ends[:-1], r_ends[:-1], r_lp[:-1]
            if len(cols):
                out[row, cols] = align_logprobs(a_ends, r_ends, r_lp, actor_lp[row, cols])[0]
        return out.to(batch.device)

    def prepare(self, batch: RolloutBatch, student: Any, *, on_policy: bool,
                micro_batch: int | None = None) -> DistillBatch:
        """`batch` with the teacher's side attached. Across tokenizers, a completion is scored up to its first
        token that adds no text, which gets :data:`UNSCORABLE_LOGPROB` (the returned batch's `completion_mask` is
        the scored tokens)."""
        if self.cross is None:
            return DistillBatch(batch, self.teacher_side(batch, student, micro_batch=micro_batch), on_policy)
        scored, textless = self._cut_at_textless(batch)
        aligned = dataclasses.replace(scored, completion_mask=scored.completion_mask * (~textless).long())
        teacher = self.teacher_side(aligned, student, micro_batch=micro_batch)
        teacher[textless] = UNSCORABLE_LOGPROB
        return DistillBatch(scored, teacher, on_policy)

    def _cut_at_textless(self, batch: RolloutBatch) -> tuple[RolloutBatch, torch.Tensor]:
        """`(batch scored up to and including each row's first text-less completion token, where those tokens are)`."""
        tokenizer = self.cross.actor_tokenizer
        textless_ids = [t for t in tokenizer.all_special_ids if t != tokenizer.eos_token_id]
        mask = batch.completion_mask.bool()
        textless = torch.isin(batch.completion_ids, torch.as_tensor(textless_ids, device=batch.device)) & mask
        if not textless.any():
            return batch, textless
        first = torch.where(textless.any(-1), textless.int().argmax(-1), textless.shape[1])
        cols = torch.arange(textless.shape[1], device=batch.device)
        keep = mask & (cols.unsqueeze(0) <= first.unsqueeze(1))
        textless = textless & (cols.unsqueeze(0) == first.unsqueeze(1))
        return dataclasses.replace(batch, completion_mask=keep.long()), textless

    def token_sum(self, out: torch.Tensor, mb: DistillBatch) -> torch.Tensor:
        """The loss summed over the micro-batch's counted completion tokens."""
        mask = mb.batch.completion_mask
        if not self.sampled:
            jsd = generalized_jsd(out, mb.teacher, beta=float(self.config.beta)).sum(-1)
            return (jsd * mask.to(jsd.dtype)).sum()
        loss, kl = sampled_token_distillation_loss(out, mb.teacher, mask, on_policy=mb.on_policy)
        # on the student's samples the value is the reverse-KL estimate and the gradient the surrogate's
        return loss - loss.detach() + kl if mb.on_policy else loss

    def loss_fn(self, out: torch.Tensor, mb: DistillBatch) -> tuple[torch.Tensor, dict[str, Any]]:
        """`(loss, metrics)` of one micro-batch for the engine's `forward_backward`: its token sum divided by the
        step's token count (`mb.num_items`)."""
        return self.token_sum(out, mb) / mb.num_items, {}
