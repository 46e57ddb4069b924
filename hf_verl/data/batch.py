"""The typed rollout batch that crosses every role boundary (rollout, reward, reference, critic, actor).

Layout: prompts are *left*-padded ``(B, P)`` and completions *right*-padded ``(B, C)``, so that
``cat([prompt_ids, completion_ids], 1)`` is a valid causal-LM input whose last ``C`` positions are
the completion. Per-token tensors are ``(B, C)``, per-sample tensors ``(B,)``. All shape, dtype
and device checks live in :meth:`RolloutBatch.validate`; every producer calls it once, so no
consumer re-checks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

# field name -> (rank, kind) where kind is "long", "mask" or "float"
_TENSOR_SPEC: dict[str, tuple[str, str]] = {
    "prompt_ids": ("BP", "long"),
    "prompt_mask": ("BP", "mask"),
    "completion_ids": ("BC", "long"),
    "completion_mask": ("BC", "mask"),
    "completion_attention_mask": ("BC", "mask"),
    "sampling_logprobs": ("BC", "float"),
    "old_logprobs": ("BC", "float"),
    "ref_logprobs": ("BC", "float"),
    "values": ("BC", "float"),
    "token_rewards": ("BC", "float"),
    "returns": ("BC", "float"),
    "rewards": ("B", "float"),
    "advantages": ("B|BC", "float"),
    "is_weights": ("BC|B1", "float"),
    "weight_version": ("B", "long"),
    "token_weight_version": ("BC", "long"),
    "is_truncated": ("B", "mask"),
    # routing replay: the experts the rollout routed each token to, (B, P | C, layers, top_k), -1 where none
    "prompt_routed_experts": ("BP+", "index"),
    "completion_routed_experts": ("BC+", "index"),
}
NOT_ROUTED = -1  # a routing record's value for a token no forward routed (hf_verl.moe.routing.NOT_ROUTED)


@dataclass(frozen=True)
class LossInputs:
    """The values a micro-batch's loss needs that span ranks or the whole step, computed before the engine's
    step (a loss function runs no collective) and carried on the micro-batch.

    Attributes:
        loss_normalizer (`float`, *optional*): the token count a token-mean loss divides by (the global
            count of the step's tokens over the data-parallel size); `None`: the micro-batch's own.
        token_normalizer (`float`, *optional*): the token count of the entropy bonus's mean; `None`: the
            micro-batch's own.
        entropy_threshold (`float`, *optional*): train only tokens whose entropy is at least this value (TRL's
            `top_entropy_quantile`, taken over every rank's tokens of this micro-batch); `None`: every token.
    """

    loss_normalizer: float | None = None
    token_normalizer: float | None = None
    entropy_threshold: float | None = None


@dataclass
class RolloutBatch:
    """Token ids, masks and per-token / per-sample statistics of a batch of completions.

    Required: `prompt_ids`, `prompt_mask`, `completion_ids`, `completion_mask`. Everything else is
    filled in by later phases (`None` until then). `completion_mask` selects the tokens that are
    trained on and scored; `completion_attention_mask`, when set, is the completion's attention mask
    (1 on every real token, tool observations included; multi-turn rollouts). `is_weights` are the
    importance weights that correct an off-policy rollout's loss (`(B, C)`, or `(B, 1)` per sequence);
    `prompt_routed_experts` / `completion_routed_experts` (`(B, P, layers, top_k)` / `(B, C, layers, top_k)`,
    integers, -1 where no forward routed the token) the experts a Mixture-of-Experts rollout routed each token to
    (routing replay, :mod:`hf_verl.moe.routing`); `token_weight_version` (`(B, C)`) the policy version behind each
    completion token when weights were updated while it generated (in-flight weight updates); and `loss_inputs` the loss's step-wide values ([`LossInputs`]). `meta` holds the
    non-tensor side (prompt and completion texts, extra dataset columns, a trace id), each list
    aligned with the batch.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    sampling_logprobs: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    token_rewards: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    rewards: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    weight_version: torch.Tensor | None = None
    is_truncated: torch.Tensor | None = None
    completion_attention_mask: torch.Tensor | None = None
    is_weights: torch.Tensor | None = None
    prompt_routed_experts: torch.Tensor | None = None
    completion_routed_experts: torch.Tensor | None = None
    token_weight_version: torch.Tensor | None = None
    loss_inputs: LossInputs = field(default_factory=LossInputs)
    meta: dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------ construction helpers
    @classmethod
    def from_lists(
        cls,
        prompt_ids: Sequence[Sequence[int]],
        completion_ids: Sequence[Sequence[int]],
        pad_token_id: int,
        *,
        sampling_logprobs: Sequence[Sequence[float]] | None = None,
        device: torch.device | str | None = None,
        **kwargs: Any,
    ) -> RolloutBatch:
        """Pad ragged prompt/completion id lists into a batch (prompts left, completions right)."""
        if len(prompt_ids) != len(completion_ids):
            raise ValueError(
                f"{len(prompt_ids)} prompts but {len(completion_ids)} completions."
            )
        p_ids, p_mask = pad_sequences(prompt_ids, pad_token_id, side="left", device=device)
        c_ids, c_mask = pad_sequences(completion_ids, pad_token_id, side="right", device=device)
        if sampling_logprobs is not None:
            lp, _ = pad_sequences(sampling_logprobs, 0.0, side="right", device=device,
                                  dtype=torch.float32, width=c_ids.shape[1])
            kwargs["sampling_logprobs"] = lp
        batch = cls(p_ids, p_mask, c_ids, c_mask, **kwargs)
        batch.validate()
        return batch

    # ------------------------------------------------------------------ views
    @property
    def batch_size(self) -> int:
        return self.prompt_ids.shape[0]

    @property
    def device(self) -> torch.device:
        return self.prompt_ids.device

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        """`cat([prompt_mask, completion part], 1)`: the completion part is `completion_attention_mask` when set
        (multi-turn rollouts: tool observations are attended and positioned but not trained on), else
        `completion_mask`."""
        completion = self.completion_mask if self.completion_attention_mask is None else self.completion_attention_mask
        return torch.cat([self.prompt_mask, completion], dim=1)

    @property
    def routed_experts(self) -> torch.Tensor | None:
        """`(B, P + C, layers, top_k)`: the routing record of `input_ids`' tokens, or None without one."""
        if self.prompt_routed_experts is None or self.completion_routed_experts is None:
            return None
        return torch.cat([self.prompt_routed_experts, self.completion_routed_experts], dim=1)

    @property
    def num_completion_tokens(self) -> int:
        return int(self.completion_mask.sum())

    def tensor_fields(self) -> dict[str, torch.Tensor]:
        return {
            name: getattr(self, name)
            for name in _TENSOR_SPEC
            if getattr(self, name) is not None
        }

    # ------------------------------------------------------------------ validation
    def validate(self) -> RolloutBatch:
        """Check every present tensor's rank, shape, dtype and device; raise with the field name."""
        B, P = _shape2(self.prompt_ids, "prompt_ids")
        _, C = _shape2(self.completion_ids, "completion_ids")
        device = self.prompt_ids.device
        dims = {"B": (B,), "BP": (B, P), "BC": (B, C), "B1": (B, 1)}
        for name, tensor in self.tensor_fields().items():
            rank, kind = _TENSOR_SPEC[name]
            allowed = [dims[r.rstrip("+")] for r in rank.split("|")]
            shape = tuple(tensor.shape)
            if rank.endswith("+"):  # trailing axes of the field's own (layers, top_k)
                if tensor.dim() != 4:
                    raise ValueError(f"RolloutBatch.{name} must be 4-D (batch, length, layers, top_k), got "
                                     f"{shape}.")
                shape = shape[:2]
            if shape not in allowed:
                want = " or ".join(str(a) for a in allowed)
                raise ValueError(
                    f"RolloutBatch.{name} has shape {tuple(tensor.shape)}, expected {want} "
                    f"(batch={B}, prompt_len={P}, completion_len={C})."
                )
            if tensor.device != device:
                raise ValueError(
                    f"RolloutBatch.{name} is on {tensor.device} but prompt_ids is on {device}; "
                    "move the batch with .to(device)."
                )
            if kind == "long" and tensor.dtype != torch.long:
                raise TypeError(f"RolloutBatch.{name} must be int64, got {tensor.dtype}.")
            if kind == "mask" and tensor.dtype not in (torch.long, torch.bool, torch.int32):
                raise TypeError(f"RolloutBatch.{name} must be an integer or bool mask, got {tensor.dtype}.")
            if kind == "index" and (tensor.is_floating_point() or tensor.dtype == torch.bool):
                raise TypeError(f"RolloutBatch.{name} must be an integer tensor, got {tensor.dtype}.")
            if kind == "float" and not tensor.is_floating_point():
                raise TypeError(f"RolloutBatch.{name} must be floating point, got {tensor.dtype}.")
        for key, value in self.meta.items():
            if isinstance(value, list) and len(value) != B:
                raise ValueError(f"RolloutBatch.meta[{key!r}] has {len(value)} items for a batch of {B}.")
        return self

    # ------------------------------------------------------------------ moves and slicing
    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> RolloutBatch:
        """Move every tensor to `device`; `dtype`, if given, applies to floating tensors only."""
        changes = {}
        for name, tensor in self.tensor_fields().items():
            target_dtype = dtype if (dtype is not None and tensor.is_floating_point()) else None
            changes[name] = tensor.to(device=device, dtype=target_dtype)
        return dataclasses.replace(self, **changes)

    def select(self, index: torch.Tensor | slice | Sequence[int]) -> RolloutBatch:
        """Rows `index` of every tensor and of every per-sample list in `meta`."""
        if isinstance(index, slice):
            rows = list(range(self.batch_size))[index]
        elif isinstance(index, torch.Tensor):
            rows = index.tolist()
        else:
            rows = list(index)
        idx = torch.as_tensor(rows, dtype=torch.long, device=self.device)
        changes: dict[str, Any] = {n: t.index_select(0, idx) for n, t in self.tensor_fields().items()}
        changes["meta"] = {
            k: ([v[i] for i in rows] if isinstance(v, list) else v) for k, v in self.meta.items()
        }
        return dataclasses.replace(self, **changes)

    def pad_to_multiple(self, multiple: int | None, pad_token_id: int) -> RolloutBatch:
        """The batch with prompts left-padded and completions right-padded to a multiple of `multiple`
        tokens (TRL's `pad_to_multiple_of`: fixed shapes for compilers and kernels); masks are 0 on the
        added positions, so every loss and statistic is unchanged. `None` or 1 returns the batch itself."""
        if multiple is None or multiple <= 1:
            return self
        P, C = self.prompt_ids.shape[1], self.completion_ids.shape[1]  # noqa: N806
        extra_p, extra_c = -P % multiple, -C % multiple
        if not extra_p and not extra_c:
            return self
        changes: dict[str, Any] = {}
        for name, tensor in self.tensor_fields().items():
            if _TENSOR_SPEC[name][1] == "index":  # a routing record: (B, length, layers, top_k), -1 added
                extra = extra_p if _TENSOR_SPEC[name][0] == "BP+" else extra_c
                fill = tensor.new_full((tensor.shape[0], extra, *tensor.shape[2:]), NOT_ROUTED)
                parts = [fill, tensor] if _TENSOR_SPEC[name][0] == "BP+" else [tensor, fill]
                changes[name] = torch.cat(parts, dim=1)
                continue
            if tensor.dim() != 2 or (name == "is_weights" and tensor.shape[1] == 1 and C != 1):
                continue  # per-sequence importance weights have no token axis
            value = pad_token_id if name.endswith("_ids") else 0
            if _TENSOR_SPEC[name][0] == "BP":
                changes[name] = torch.nn.functional.pad(tensor, (extra_p, 0), value=value)
            else:
                changes[name] = torch.nn.functional.pad(tensor, (0, extra_c), value=value)
        return dataclasses.replace(self, **changes).validate()

    def split(self, size: int) -> list[RolloutBatch]:
        """Consecutive chunks of at most `size` rows (micro-batches)."""
        if size < 1:
            raise ValueError(f"split size must be >= 1, got {size}.")
        return [self.select(slice(i, i + size)) for i in range(0, self.batch_size, size)]


def resolve_pad_to_multiple_of(value: int | str | None) -> int | None:
    """TRL's `pad_to_multiple_of`: "auto" (None off Neuron devices), "none"/"null", or a positive int."""
    if isinstance(value, str):
        if value == "auto" or value.lower() in ("none", "null"):
            return None
        value = int(value)
    if value is not None and value < 1:
        raise ValueError(f"pad_to_multiple_of must be a positive integer, 'auto' or None, got {value}.")
    return value


def pad_sequences(
    seqs: Sequence[Sequence[int | float]],
    pad_value: int | float,
    *,
    side: str,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.long,
    width: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad ragged sequences to one width. Returns (values, mask) with mask 1 on real entries."""
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}.")
    width = max((len(s) for s in seqs), default=0) if width is None else width
    out = torch.full((len(seqs), width), pad_value, dtype=dtype)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        n = len(s)
        if n == 0:
            continue
        if n > width:
            raise ValueError(f"sequence {i} has length {n} > pad width {width}.")
        sl = slice(width - n, width) if side == "left" else slice(0, n)
        out[i, sl] = torch.as_tensor(list(s), dtype=dtype)
        mask[i, sl] = 1
    if device is not None:
        out, mask = out.to(device), mask.to(device)
    return out, mask


def _shape2(tensor: torch.Tensor, name: str) -> tuple[int, int]:
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != 2:
        shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ValueError(f"RolloutBatch.{name} must be a 2-D tensor (batch, length), got {shape}.")
    return tensor.shape[0], tensor.shape[1]
