"""The routers of a transformers Mixture-of-Experts model, and a tap on them: record the experts each token is
routed to, or route each token to recorded experts (rollout routing replay).

Why replay: the rollout engine and the training forward route tokens differently (bf16 against fp32, other
kernels, other batch composition), so the policy ratio of a token whose experts changed compares two different
computations; GRPO on MoE models drifts or collapses without it. With replay, the training forward sends every
token to the experts the rollout chose and recomputes their gate weights from its own router logits, so the
gradient still reaches the router.

transformers 5 gives every MoE family of the Qwen / Mixtral line a router module (`*TopKRouter`) whose forward
returns `(router_logits, router_scores, router_indices)` over the flattened tokens of the forward
(`(N, num_experts)`, `(N, top_k)`, `(N, top_k)`); the experts module takes the scores and indices. The tap is a
forward hook on those modules (no patch of transformers code): it keeps the indices, and in replay replaces the
scores and indices. How a router weighs a given set of experts is a rule per router class (:data:`WEIGHT_RULES`),
checked against the router's own output on its own choice the first time it is used, so an unknown router is
refused instead of replayed wrongly.

Layout of a routing record: an integer tensor `(tokens, layers, top_k)` with :data:`NOT_ROUTED` (-1) where a token
has no record (padding, the last sampled token, which no forward consumed); such a token keeps the router's own
choice.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import ClassVar

import torch

NOT_ROUTED = -1
"""A routing record's value for a token that no forward routed (padding, a completion's last token)."""


def find_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The top-k routers of a transformers Mixture-of-Experts model in layer order (empty for a dense model).
    Wrappers (DDP, PEFT, FSDP2, DeepSpeed) are looked through: their modules are the model's."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


def is_moe_model(model: torch.nn.Module) -> bool:
    """Whether `model` routes tokens through top-k routers :class:`RoutingTap` can record and replay."""
    return bool(find_routers(model))


def fit_record(record, tokens: int) -> torch.Tensor:
    """A routing record `(n, layers, top_k)` (a tensor or an array, e.g. vLLM's `routed_experts`) cut or extended
    with :data:`NOT_ROUTED` to `tokens` rows (an engine that never routed the last sampled token returns one
    row fewer)."""
    if record is None:
        raise ValueError("the rollout engine returned no routing record although one was asked for (router_replay).")
    record = torch.as_tensor(record).to(torch.int32)
    if record.dim() != 3:
        raise ValueError(f"a routing record must be (tokens, layers, top_k), got {tuple(record.shape)}.")
    if record.shape[0] >= tokens:
        return record[:tokens]
    pad = record.new_full((tokens - record.shape[0], *record.shape[1:]), NOT_ROUTED)
    return torch.cat([record, pad])


def _softmax_then_select(renormalize: Callable[[torch.nn.Module], bool]):
    def weights(router: torch.nn.Module, logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(logits.float(), dim=-1)
        chosen = probs.gather(-1, indices)
        if renormalize(router):
            chosen = chosen / chosen.sum(dim=-1, keepdim=True)
        return chosen

    return weights


WEIGHT_RULES: dict[str, Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    # softmax over all experts, the chosen ones' probabilities, renormalised when the config says so
    "Qwen3MoeTopKRouter": _softmax_then_select(lambda r: bool(r.norm_topk_prob)),
    "Qwen2MoeTopKRouter": _softmax_then_select(lambda r: bool(r.norm_topk_prob)),
    "OlmoeTopKRouter": _softmax_then_select(lambda r: bool(getattr(r, "norm_topk_prob", False))),
    # Mixtral always renormalises the chosen experts' probabilities
    "MixtralTopKRouter": _softmax_then_select(lambda r: True),
}
"""Router class name -> `weights(router, logits (N, E), indices (N, k)) -> (N, k)`: the gate weights the router
gives experts `indices`, from its logits (the same formula its forward applies to its own top-k)."""


class RoutingTap:
    """Forward hooks on a model's routers: :meth:`recording` keeps the experts every token was routed to and,
    given a record, routes each token to the recorded experts. One tap per model (:meth:`of`).

    Attributes:
        routers (`list[torch.nn.Module]`): the hooked routers, in layer order.
        num_experts (`int`): experts per layer.
        top_k (`int`): experts per token.
    """

    _taps: ClassVar[weakref.WeakKeyDictionary] = weakref.WeakKeyDictionary()

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = find_routers(model)
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no top-k routers: it is not a Mixture-of-Experts model.")
        first = self.routers[0]
        self.num_experts = int(getattr(first, "num_experts", 0) or first.weight.shape[0])
        self.top_k = int(first.top_k)
        self._captures: list[list[torch.Tensor]] | None = None
        self._replay: torch.Tensor | None = None
        self._window = 0
        self._checked: set[str] = set()
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    @classmethod
    def of(cls, model: torch.nn.Module) -> RoutingTap | None:
        """The model's tap (hooks registered once per model), or None for a dense model."""
        if model in cls._taps:  # a dense model is remembered as None: no module scan per forward
            return cls._taps[model]
        tap = cls._taps[model] = cls(model) if is_moe_model(model) else None
        return tap

    @property
    def num_layers(self) -> int:
        return len(self.routers)

    # ------------------------------------------------------------------ the hook
    def _hook(self, layer: int):
        def hook(module: torch.nn.Module, _args, output):
            if not (isinstance(output, tuple) and len(output) == 3):
                raise TypeError(f"{type(module).__name__}.forward returned {type(output).__name__}, not "
                                "(router_logits, router_scores, router_indices): routing cannot be recorded.")
            logits, scores, indices = output
            if self._captures is not None:
                self._captures[layer].append(indices.detach())
            replay = self._replay
            if replay is None:
                return None
            if replay.shape[0] != indices.shape[0] or replay.shape[2] != indices.shape[1]:
                raise ValueError(f"routing replay: the forward routes {indices.shape[0]} tokens to "
                                 f"{indices.shape[1]} experts each, the record has {replay.shape[0]} tokens x "
                                 f"{replay.shape[2]} experts (the batch's routing does not match its tokens).")
            chosen = replay[:, layer].to(device=indices.device, dtype=indices.dtype)
            recorded = (chosen >= 0).all(dim=-1, keepdim=True)
            chosen = torch.where(recorded, chosen, indices)
            rule = self._rule(module, logits, scores, indices)
            return logits, rule(module, logits, chosen).to(scores.dtype), chosen

        return hook

    def _rule(self, router: torch.nn.Module, logits: torch.Tensor, scores: torch.Tensor, indices: torch.Tensor):
        """The router class's weight rule, checked once against its own output on its own choice."""
        name = type(router).__name__
        rule = WEIGHT_RULES.get(name)
        if rule is None:
            raise ValueError(f"routing replay does not know how {name} weighs its experts (known: "
                             f"{sorted(WEIGHT_RULES)}); add its rule to hf_verl.moe.routing.WEIGHT_RULES, or set "
                             "router_replay=False.")
        if name not in self._checked:
            with torch.no_grad():
                mine = rule(router, logits.detach(), indices).to(scores.dtype)
            if not torch.allclose(mine.float(), scores.detach().float(), rtol=1e-3, atol=1e-5):
                raise ValueError(f"routing replay's weight rule for {name} does not reproduce the router's own "
                                 "gate weights; fix its entry in hf_verl.moe.routing.WEIGHT_RULES or set "
                                 "router_replay=False.")
            self._checked.add(name)
        return rule

    # ------------------------------------------------------------------ recording
    def start(self, replay: torch.Tensor | None = None) -> None:
        """Begin a forward: keep every router's choices from now on; `replay` `(N, layers, top_k)` (or None)
        routes the forward's `N` tokens to those experts."""
        if replay is not None and (replay.dim() != 3 or replay.shape[1] != self.num_layers):
            raise ValueError(f"a routing record must be (tokens, {self.num_layers} layers, top_k), got "
                             f"{tuple(replay.shape)}.")
        self._captures = [[] for _ in self.routers]
        self._replay = replay

    def take(self) -> torch.Tensor:
        """The router choices since :meth:`start` or the last :meth:`take`, `(N, layers, top_k)` long, in the
        order the model flattened its tokens (rows, then positions)."""
        if self._captures is None:
            raise RuntimeError("RoutingTap.take() outside a recording.")
        per_layer = [torch.cat(c) if c else torch.empty(0, self.top_k, dtype=torch.long) for c in self._captures]
        self._captures = [[] for _ in self.routers]
        sizes = {t.shape[0] for t in per_layer}
        if len(sizes) != 1:
            raise RuntimeError(f"the routers saw different token counts {sorted(sizes)} in one forward; routing "
                               "cannot be recorded for this model.")
        return torch.stack(per_layer, dim=1)

    def stop(self) -> None:
        """End a forward: stop recording; the replay stays in force while a :meth:`window` is open (a backward
        that recomputes checkpointed layers routes as the forward did)."""
        self._captures = None
        if self._window == 0:
            self._replay = None

    @contextlib.contextmanager
    def recording(self, replay: torch.Tensor | None = None) -> Iterator[RoutingTap]:
        """:meth:`start` ... :meth:`stop` as a context."""
        self.start(replay)
        try:
            yield self
        finally:
            self.stop()

    @contextlib.contextmanager
    def window(self) -> Iterator[None]:
        """A forward and its backward: a replay set inside stays until the window closes."""
        self._window += 1
        try:
            yield
        finally:
            self._window -= 1
            if self._window == 0:
                self._replay = None
