"""The scoring part of an engine: what a role answers about a batch without training on it.

:class:`ScoringEngine` is the part the RL code recognises: a role that answers `infer(batch, request)`
(reference and old log-probs, a critic's values). A served reference
(:class:`~hf_verl.engine.remote_reference.RemoteReference`) is one and nothing more.

:class:`ModelScoring` is scoring by a model this process runs, on two forward primitives:

- :meth:`ModelScoring.token_logprobs`: log-probs (and entropy, mean logit) of chosen next tokens at selected
  positions of a batch of sequences, padded or packed; RL rollouts and DPO pairs are both expressed as
  (input ids, positions, targets);
- :meth:`ModelScoring.token_values`: a value head's output at selected positions (the critic).

:meth:`ModelScoring.logprobs` and :meth:`ModelScoring.values` express a :class:`~hf_verl.data.batch.RolloutBatch`
(left-padded prompt, right-padded completion) in those terms and return `(B, C)` tensors aligned with
`completion_ids`, zero on padding. How rows are laid out for a forward (padded, packed padding-free, each prompt
laid out once) is an engine's own policy: transformers-based engines take
:class:`~hf_verl.engine.hf_layouts.HFLayouts`; the Megatron engine has its own.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

import torch

from hf_verl.data.batch import RolloutBatch
from hf_verl.engine.parts.model import EngineModel
from hf_verl.engine.step import ForwardRequest, PolicyOutput
from hf_verl.parallel import watchdog


@dataclass
class TokenStats:
    """Per-position results of :meth:`ModelScoring.token_logprobs`, one entry per selected position
    (row-major order of the selection mask)."""

    logp: torch.Tensor
    entropy: torch.Tensor | None = None
    mean_logit: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None  # a Mixture of Experts' router load-balancing loss, when asked
    log_sum_sq: torch.Tensor | None = None  # log sum_v p_v^2 per position (no gradient), when asked


class ScoringEngine(abc.ABC):
    """A role that scores batches (see the module docstring): what a reference, an old policy or a critic is
    asked for, wherever its model runs.

    Attributes:
        role (`str`): the role named in errors and logs.
        device (`torch.device`): where the batches it is given should be (and its answers are).
    """

    role: str
    device: torch.device

    @abc.abstractmethod
    def infer(self, batch: Any, forward: ForwardRequest, *, micro_batch: int | None = None) -> Any:
        """`forward` over `batch` without gradients (a :class:`~hf_verl.engine.step.LogProbs` request answers a
        :class:`~hf_verl.engine.step.PolicyOutput` of `(B, C)` tensors), `micro_batch` rows at a time where the
        engine runs them itself."""


class ModelScoring(ScoringEngine, EngineModel):
    """Scoring by a model this process runs, on the forward primitives (see the module docstring).

    Attributes:
        padding_free / shared_prefix (`bool`, *optional*): the layout switches of engines that lay rows out
            themselves (:class:`~hf_verl.engine.hf_layouts.HFLayouts`).
    """

    padding_free: bool | None = None
    shared_prefix: bool | None = None

    @abc.abstractmethod
    def token_logprobs(self, input_ids: torch.Tensor, targets: torch.Tensor, select: torch.Tensor, *,
                       attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                       temperature: float = 1.0, chunk_size: int = 1024, with_entropy: bool = False,
                       with_mean_logit: bool = False, with_aux_loss: bool = False,
                       with_log_sum_sq: bool = False) -> TokenStats:
        """Log-probs of `targets[select]` given the prefix up to each selected position (and the router
        load-balancing loss of a Mixture-of-Experts model with `with_aux_loss`).

        Args:
            input_ids (`torch.Tensor` `(B, T)`): token ids (padded rows, or one packed row).
            targets (`torch.Tensor` `(B, T)`): at each selected position, the next token to score.
            select (`torch.Tensor` `(B, T)` bool): the positions to score; or `(N,)` long, flat positions into
                `B * T` in the order of the result, with `targets` `(N,)` (see :func:`select_positions`).
            attention_mask / position_ids: as the model takes them (packed rows: position ids only).
            temperature (`float`): logits are divided by it. chunk_size (`int`): positions per LM-head chunk.
            with_entropy / with_mean_logit (`bool`): also return those per position.
            model_inputs (`dict`, *optional*): more keyword inputs of the model's forward (a vision-language
                model's pixel inputs); engines that take them accept the keyword, the others need not.
        """

    @abc.abstractmethod
    def token_values(self, input_ids: torch.Tensor, select: torch.Tensor, *,
                     attention_mask: torch.Tensor | None = None,
                     position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The value head at `select` positions `(N,)` (a critic: sequence-classification model, one label)."""

    @abc.abstractmethod
    def logprobs(self, batch: RolloutBatch, *, temperature: float = 1.0, chunk_size: int = 1024,
                 with_entropy: bool = False, with_aux_loss: bool = False):
        """`(B, C)` log-probs of a rollout's completion tokens (and entropy if asked), 0 on padding.

        Returns:
            `(logp, entropy)`; with `with_aux_loss`, `(logp, entropy, aux_loss)` where `aux_loss` is the
            model's router load-balancing loss of this forward (a Mixture-of-Experts model).
        """

    @abc.abstractmethod
    def sampling_statistics(self, batch: RolloutBatch, *, temperature: float = 1.0,
                            chunk_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
        """`(B, C)` log-probs of a rollout's completion tokens and `sum_v pi_v^2` at each of them (no gradient;
        0 on padding)."""

    @abc.abstractmethod
    def values(self, batch: RolloutBatch) -> torch.Tensor:
        """`(B, C)` critic values of the states before each completion token, 0 on padding."""

    def autocast(self) -> contextlib.AbstractContextManager:
        """The mixed-precision context of this engine's forwards (none by default)."""
        return contextlib.nullcontext()

    @torch.no_grad()
    def infer(self, batch: Any, forward: ForwardRequest, *, micro_batch: int | None = None) -> Any:
        """`forward` over `batch` without gradients, in eval mode, `micro_batch` rows at a time (the reference's
        and the old policy's log-probs, a critic's values); tensor outputs are concatenated over the rows and a
        :class:`PolicyOutput` field by field. The engine's train / eval mode is restored afterwards."""
        was_training = self.training
        self.train(False)
        name = "".join("_" + c.lower() if c.isupper() else c for c in type(forward).__name__).lstrip("_")
        try:
            with watchdog.phase(name, role=self.role), watchdog.phase("forward", collective=self._forward_collective()):
                if micro_batch is None:  # one forward over the whole batch (any type the request takes)
                    parts = [forward.run(self, batch)]
                else:
                    parts = [forward.run(self, chunk) for chunk in row_chunks(batch, micro_batch)]
        finally:
            self.train(was_training)
        return concat_outputs(parts)


def row_chunks(batch: Any, micro_batch: int) -> Iterator[Any]:
    """`batch` in chunks of `micro_batch` rows (at least one row each), in order, each selected when reached."""
    size = max(1, micro_batch)
    for i in range(0, batch.batch_size, size):
        yield batch.select(slice(i, i + size))


def concat_outputs(parts: list[Any]) -> Any:
    """Concatenate per-chunk outputs over their rows: tensors, :class:`PolicyOutput` field by field, tuples
    element by element (a `None` field stays None)."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.stack(parts).mean() if first.dim() == 0 else torch.cat(parts)  # a scalar: its mean
    if isinstance(first, PolicyOutput):
        return PolicyOutput(*(concat_outputs([getattr(p, f.name) for p in parts]) for f in fields(PolicyOutput)))
    if isinstance(first, tuple):
        return tuple(concat_outputs(list(items)) for items in zip(*parts))
    if first is None:
        return None
    if isinstance(first, dict):  # per-chunk metrics (routing): each key's mean over the chunks that have it
        keys = {k for p in parts for k in p}
        return {k: sum(p[k] for p in parts if k in p) / sum(k in p for p in parts) for k in keys}
    raise TypeError(f"infer() cannot concatenate outputs of type {type(first).__name__}; run one chunk "
                    "(micro_batch=None) or return tensors.")
