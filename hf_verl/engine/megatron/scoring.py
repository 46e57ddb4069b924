"""`MegatronScoring`: the scoring part of the Megatron engine, as forward plans.

A request's forward on Megatron-Core is a :class:`Plan`: the stage's inputs (token ids, positions, a `(B, 1, T, T)`
mask) and a `finish` that turns the last stage's output into the request's answer. The plan is what lets the
pipeline schedule run a request stage by stage (:meth:`MegatronScoring._plan`, which
:meth:`~hf_verl.engine.megatron.engine.MegatronEngine.forward_backward` calls for every micro-batch), and what the
primitives run in one call at `pp=1`.

Log-probs never gather the vocabulary: a forward pre-hook on the LM head (:meth:`MegatronScoring._select_head_rows`)
takes the final hidden states of the scored positions away from Megatron's head call, and the plan's `finish` runs
the vocabulary-parallel head on them a chunk at a time (:meth:`MegatronScoring._head_stats`), reducing one number
per position across the slices (:func:`~hf_verl.parallel.megatron.vocab.token_stats`). Prompt and padding positions
never reach the head.

A Mixture of Experts' router load-balancing loss (`with_aux_loss`) is the accelerate engines' own: transformers'
`load_balancing_loss_func` over every layer's router logits of the micro-batch, padding excluded by the attention
mask (:func:`load_balancing_loss`), which the algorithm weights by `router_aux_loss_coef`. Megatron's per-layer aux
loss (which it adds to the gradient itself, with another normalisation) is switched off in the model's config; a
forward hook on each layer's router (`decoder.layers[i].mlp.router`, left in place for other hooks) recomputes its
logits from its input while a plan asks for them, so the loss and its gradient reach the router and the layers
below. As on the accelerate engines (:mod:`hf_verl.engine.router_loss`), it is the global batch's: the expert
counts and probability sums are all-reduced over the data-parallel ranks, so every rank has the one-process value.

Under sequence parallelism (an MoE at TP > 1: Megatron-Core trains one under TP only so) each TP rank holds a slice
of the sequence between the layers: a plan's rows are padded to a multiple of TP (masked positions that nothing
scores, :meth:`MegatronScoring._sequence_parallel_pad`), the LM head's pre-hook and the value head gather the
sequence, and the router logits are gathered before the aux loss.

Requests served at every layout: :class:`~hf_verl.engine.step.LogProbs`, :class:`~hf_verl.engine.step.Values`,
:class:`~hf_verl.engine.step.SamplingStatistics`, and any request that states its forward as a
:class:`~hf_verl.engine.step.TokenQuery` (DPO's pairs); at `pp=1` also any other request built on the primitives
:meth:`~MegatronScoring.token_logprobs` / :meth:`~MegatronScoring.token_values`.
"""

from __future__ import annotations

import contextlib

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from hf_verl.data.batch import RolloutBatch
from hf_verl.engine.hf_layouts import position_ids_from_mask, rollout_positions, scatter_completion
from hf_verl.engine.parts.scoring import ModelScoring, TokenStats
from hf_verl.engine.router_loss import load_balancing_sums
from hf_verl.engine.step import ForwardRequest, LogProbs, PolicyOutput, SamplingStatistics, Values
from hf_verl.parallel import comm
from hf_verl.parallel.dims import ParallelDims
from hf_verl.parallel.megatron.compat import cpu_compat
from hf_verl.parallel.megatron.vocab import token_stats


@dataclass
class Plan:
    """One micro-batch's forward: the model's inputs and what turns the last stage's output into the request's.
    `head_rows`: the positions the LM head scores (a `(B, T)` mask or a flat `(N,)` index): only those go
    through it, and the output is then `(1, N, V_local)` in that order."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor  # (B, 1, T, T) bool, True = masked
    finish: Callable[[torch.Tensor], Any]
    head_rows: torch.Tensor | None = None
    head_hidden: torch.Tensor | None = None  # the scored positions' final hidden states, set during the forward
    token_mask: torch.Tensor | None = None  # (B, T) the aux loss's padding mask (None: every token counts)
    router_logits: list[torch.Tensor] | None = None  # each MoE layer's [T, B, E] router logits, when the aux loss is asked
    replay: torch.Tensor | None = None  # routing replay: the rollout's record (B, T, layers, top_k), -1 where none
    routing: list | None = None  # MoE routing metrics: each layer's (routers' own top-k, experts used), router order
    routing_mask: torch.Tensor | None = None  # (B, T) real tokens, laid out as the routers see them in _run
    routing_record: torch.Tensor | None = None  # the replayed record in the routers' order (N, layers, top_k)


def load_balancing_loss(router_logits: list[torch.Tensor], top_k: int, mask: torch.Tensor | None,
                        dims: ParallelDims | None = None) -> torch.Tensor:
    """transformers' `load_balancing_loss_func` (Switch Transformer's, over all layers at once) of Megatron's
    `[T, B, E]` router logits of every MoE layer, `mask` `(B, T)` excluding padding (None: every token): the number
    of experts x sum over experts of (fraction of top-k assignments) x (mean routing probability). With `dims` of
    several data-parallel ranks it is the accelerate engines' global one
    (:func:`~hf_verl.engine.router_loss.global_load_balancing_loss`): counts and probability sums all-reduced over
    the data-parallel group, this rank's differentiable part scaled by the ranks (DDP averages it back)."""
    experts = router_logits[0].shape[-1]
    flat = tuple(x.transpose(0, 1).reshape(-1, experts) for x in router_logits)  # HF's (B x T, E) order
    counts, probs, rows = load_balancing_sums(flat, experts, top_k, mask)
    if dims is None or dims.dp_size == 1:
        return experts * torch.sum((counts / rows) * (probs / rows))
    total = comm.reduce(dims, torch.cat([counts, probs.detach(), rows.reshape(1)]), "sum")
    counts_all, probs_all, rows_all = total[:experts], total[experts:-1], total[-1]
    probs_part = probs_all + dims.dp_size * (probs - probs.detach())
    return experts * torch.sum(counts_all / rows_all * probs_part / rows_all)


def attention_mask_4d(mask: torch.Tensor) -> torch.Tensor:
    """Megatron's `(B, 1, T, T)` boolean mask (True = not attended) from a `(B, T)` padding mask: causal, and
    no attention to padding."""
    T = mask.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=mask.device).tril()
    return ~(causal[None, None] & mask.bool()[:, None, None, :])


class MegatronScoring(ModelScoring):
    """The scoring part on Megatron-Core (see the module docstring); mixed into
    :class:`~hf_verl.engine.megatron.engine.MegatronEngine`, which sets what it reads: `_stage` (this rank's
    stage), `_arch`, `_ctx` (the shard context), `_kind` ("causal_lm" or "value"), `_ps` (Megatron's
    `parallel_state`), `_tp_rank`, `_last` (the last pipeline stage) and `_head_plan` (the plan whose forward runs
    now)."""

    router_replay = False  # routing replay of a rollout's record (hf_verl.pipeline.role_builder sets it)

    def _hook_routers(self, stage: torch.nn.Module) -> None:
        """A forward hook on each MoE layer's router (`decoder.layers[i].mlp.router`): while the running plan asks for
        the load-balancing loss, the router's logits, recomputed from its input, are kept in the plan."""
        self._aux_plan: Plan | None = None
        self._routers: list[tuple[int, torch.nn.Module]] = []  # (global layer index, router) of this stage
        for layer in getattr(getattr(stage, "decoder", None), "layers", []):
            router = getattr(layer.mlp, "router", None)
            if router is not None:
                router.register_forward_hook(self._keep_router_logits)
                self._routers.append((int(layer.layer_number) - 1, router))

    # ------------------------------------------------------------------ routing replay
    def _replay_record(self, batch: Any) -> torch.Tensor:
        """The batch's routing record for `router_replay` (see :meth:`_replaying`), checked against what this
        engine can replay."""
        record = getattr(batch, "routed_experts", None)
        if record is None:
            raise ValueError("router_replay=True but this rollout batch carries no routing record: its rollout engine "
                             "does not record routing. Use the transformers, vllm or remote engine, or set "
                             "router_replay=False.")
        if getattr(self._config, "recompute_granularity", None) is not None:
            raise ValueError("router_replay=True on backend='megatron' does not combine with gradient_checkpointing "
                             "(Megatron's recompute would route the recomputed layers again): turn one off.")
        if any(r.router_replay is None for _, r in self._routers):
            raise ValueError("this Megatron model was built without Megatron's routing replay "
                             "(moe_enable_routing_replay); rebuild the engine.")
        return record

    def _routers_order(self, per_token: torch.Tensor) -> torch.Tensor:
        """`(B, T, ...)` per-token values in the order this rank's routers see the tokens: sequence-first
        `(T, B, ...)`, this rank's slice of the sequence under Megatron's sequence parallelism."""
        out = per_token.transpose(0, 1)
        if self._config.sequence_parallel:
            chunk = out.shape[0] // self.dims.tp
            out = out[self._tp_rank * chunk : (self._tp_rank + 1) * chunk]
        return out

    def _routing_metrics(self, plan: Plan) -> dict[str, float]:
        """The MoE routing metrics of a forward (:mod:`hf_verl.moe.metrics`), from what the router hooks kept."""
        from hf_verl.moe.metrics import routing_metrics

        if not plan.routing:
            return {}
        natural = torch.stack([n for n, _ in plan.routing], dim=1)
        return routing_metrics(natural, plan.routing_mask.reshape(-1), self._arch.num_experts,
                               recorded=plan.routing_record, replayed=plan.replay is not None)

    @contextlib.contextmanager
    def _replaying(self, plan: Plan):
        """Every router of this stage routes the plan's tokens to the recorded experts, set around each stage's
        forward of each micro-batch (a pipeline schedule replays every micro-batch on every stage) through
        Megatron-Core's own RouterReplay, `REPLAY_FORWARD`: the gate weights are the router's scores gathered at
        those experts, so the router still gets a gradient. The record is laid out as the routers see the tokens: sequence-first
        `[T, B]`, padded as the plan is, this rank's slice of the sequence under Megatron's sequence parallelism;
        a token without a record (padding, a completion's last token: neither changes a scored log-prob) gets
        experts 0..k-1."""
        if plan.replay is None:
            yield
            return
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        record = plan.replay.to(device=plan.input_ids.device, dtype=torch.long)
        B, T = plan.input_ids.shape
        if record.shape[1] < T:  # the plan was padded for sequence parallelism
            record = torch.cat([record, record.new_full((B, T - record.shape[1], *record.shape[2:]), -1)], 1)
        record = self._routers_order(record)
        plan.routing_record = record.reshape(-1, *record.shape[2:])
        k = record.shape[-1]
        record = torch.where(record >= 0, record, torch.arange(k, device=record.device))
        try:
            for layer, router in self._routers:
                router.router_replay.set_target_indices(record[:, :, layer].reshape(-1, k))
                router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            yield
        finally:
            for _, router in self._routers:
                router.router_replay.clear_indices()
                router.router_replay.clear_router_replay_action()

    def _keep_router_logits(self, module, args, output):
        metrics_plan = getattr(self, "_routing_plan", None)
        if metrics_plan is not None:  # the routers' own top-k (from their logits) and the experts the layer used
            with torch.no_grad():
                hidden = args[0].detach()
                logits = torch.nn.functional.linear(hidden.reshape(-1, hidden.shape[-1]),
                                                    module.weight.detach().to(hidden.dtype))
                k = self._arch.top_k
                metrics_plan.routing.append((logits.float().topk(k).indices, output[1].float().topk(k).indices))
        plan = self._aux_plan
        if plan is not None and plan.router_logits is not None:
            logits = torch.nn.functional.linear(args[0], module.weight.to(args[0].dtype))
            if self._config.sequence_parallel:  # every TP rank computes the loss over the whole sequence
                from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

                logits = gather_from_sequence_parallel_region(logits, tensor_parallel_output_grad=False)
            plan.router_logits.append(logits)

    def _aux_loss(self, plan: Plan) -> torch.Tensor:
        """The plan's load-balancing loss (see :func:`load_balancing_loss`), from the logits its forward kept."""
        self._aux_plan = None
        logits, plan.router_logits = plan.router_logits, []
        if len(logits) != self._arch.num_layers:
            raise RuntimeError(f"the forward kept {len(logits)} router outputs for {self._arch.num_layers} MoE layers.")
        if torch.is_grad_enabled() and self.training and not logits[0].requires_grad:
            raise ValueError("a router aux loss (router_aux_loss_coef) with gradient_checkpointing on backend='megatron' "
                             "is not supported (Megatron's recompute runs the routers without gradients): turn one off.")
        return load_balancing_loss(logits, self._arch.top_k, plan.token_mask, self.dims)

    def _select_head_rows(self, module, args, kwargs):
        """Take the final hidden states of the positions a request scores away from Megatron's LM head call: they
        go into the plan's box, and the head is called on no row (its output is not read). The plan's `finish`
        runs the head on them in chunks (:meth:`_head_stats`): prompt and padding positions never reach it."""
        plan, self._head_plan = self._head_plan, None
        if plan is None:  # not the model's forward (the plan's finish calling the head on the rows it took)
            return None
        if self._config.sequence_parallel:  # each TP rank's slice of the sequence: the head scores whole rows
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            # the head (its output layer without sequence parallelism) sums the TP ranks' gradients itself
            args = (gather_from_sequence_parallel_region(args[0], tensor_parallel_output_grad=False), *args[1:])
            if plan.head_rows is None:
                return args, kwargs
        if plan.head_rows is None:
            return None
        rows = plan.head_rows
        hidden = args[0].transpose(0, 1)  # [b, s, h]
        plan.head_hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows) if rows.dtype != torch.bool \
            else hidden[rows]
        return (args[0][:0], *args[1:]), kwargs

    def _head_stats(self, hidden: torch.Tensor, targets: torch.Tensor, *, chunk_size: int, **kwargs) -> TokenStats:
        """Token statistics of `hidden` `(N, h)` through the vocabulary-parallel LM head, a chunk of positions at a
        time (each chunk's fp32 logits within 256 MiB, recomputed in the backward instead of kept)."""
        stage = self._stage
        weight = stage.shared_embedding_or_output_weight() if stage.share_embeddings_and_output_weights else None
        v_local = self._ctx.padded_vocab_size // self.dims.tp
        step = max(1, min(chunk_size, (64 << 20) // v_local))
        start = self._tp_rank * v_local

        def chunk(h, t):
            logits, _ = stage.output_layer(h.unsqueeze(1), weight=weight)
            return token_stats(logits[:, 0], t, vocab_start=start, vocab_size=self._arch.vocab_size,
                               reduce_sum=self._tp_sum, reduce_max=self._tp_max, **kwargs)

        parts = []
        for i in range(0, max(hidden.shape[0], 1), step):
            h, t = hidden[i : i + step], targets[i : i + step]
            if torch.is_grad_enabled() and h.requires_grad:
                parts.append(torch.utils.checkpoint.checkpoint(chunk, h, t, use_reentrant=False))
            else:
                parts.append(chunk(h, t))
        logp, entropy, log_sum_sq, mean_logit = (
            None if p[0] is None else torch.cat(p) for p in zip(*parts))
        return TokenStats(logp=logp, entropy=entropy, mean_logit=mean_logit, log_sum_sq=log_sum_sq)

    def _run(self, plan: Plan, model: torch.nn.Module | None = None) -> torch.Tensor:
        """The stage's forward of a plan (the LM head on the plan's scored positions only)."""
        T = plan.input_ids.shape[1]
        if self._config.sequence_parallel:
            self._sequence_parallel_pad(plan)
        self._head_plan = plan if self._last else None
        self._aux_plan = plan if plan.router_logits is not None else None
        if plan.routing is not None:  # the real tokens in the routers' order (the plan may have been padded)
            mask = plan.routing_mask
            if mask.shape[1] < plan.input_ids.shape[1]:
                mask = torch.cat([mask, mask.new_zeros(mask.shape[0], plan.input_ids.shape[1] - mask.shape[1])], 1)
            plan.routing_mask = self._routers_order(mask)
            self._routing_plan = plan
        try:
            with cpu_compat(), self._replaying(plan):
                output = (model or self.module)(plan.input_ids, plan.position_ids, plan.attention_mask)
        finally:
            self._routing_plan = None  # a backward's recompute does not count again
        return output[:, :T] if self._last and plan.input_ids.shape[1] != T else output

    def _sequence_parallel_pad(self, plan: Plan) -> None:
        """Pad the plan's rows to a multiple of the TP degree (sequence parallelism splits the sequence): masked
        positions (each attending to itself only) that no head scores and the aux loss does not count."""
        B, T = plan.input_ids.shape
        pad = -T % self.dims.tp
        if pad == 0:
            return
        ids = plan.input_ids
        plan.input_ids = torch.cat([ids, ids.new_zeros(B, pad)], 1)
        plan.position_ids = torch.cat([plan.position_ids, plan.position_ids.new_zeros(B, pad)], 1)
        mask = torch.ones(B, 1, T + pad, T + pad, dtype=torch.bool, device=ids.device)
        mask[..., :T, :T] = plan.attention_mask
        plan.attention_mask = mask
        rows = plan.head_rows
        if rows is not None and rows.dtype == torch.bool:
            plan.head_rows = torch.cat([rows, rows.new_zeros(B, pad)], 1)
        elif rows is not None:  # flat positions into B x T
            plan.head_rows = rows // T * (T + pad) + rows % T
        if plan.router_logits is not None:
            kept = torch.ones(B, T, dtype=torch.long, device=ids.device) if plan.token_mask is None else plan.token_mask
            plan.token_mask = torch.cat([kept, kept.new_zeros(B, pad)], 1)

    def _check_length(self, T: int) -> None:
        window = self._arch.sliding_window
        if window is not None and T > window:
            raise ValueError(f"a sequence of {T} tokens exceeds the model's sliding_window={window}, which the Megatron "
                             "bridge does not apply: shorten max_prompt_length + max_completion_length, or use "
                             "another backend.")

    def _stats_plan(self, input_ids: torch.Tensor, targets: torch.Tensor, select: torch.Tensor,
                    attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None, *, temperature: float,
                    with_entropy: bool = False, with_log_sum_sq: bool = False,
                    with_mean_logit: bool = False, chunk_size: int = 1024, with_aux_loss: bool = False) -> Plan:
        if self._kind != "causal_lm":
            raise ValueError(f"the {self.role} is a value model; it has no token log-probs.")
        self._check_length(input_ids.shape[1])
        if with_aux_loss and not self._arch.is_moe:
            raise ValueError(f"the {self.role} model is not a Mixture of Experts: it has no router aux loss; set "
                             "router_aux_loss_coef=0.")
        if with_aux_loss and self.dims.pp > 1:
            raise ValueError("a router aux loss (router_aux_loss_coef) on backend='megatron' needs every MoE layer on one "
                             "stage (the loss couples the layers): set pipeline_model_parallel_size=1 or "
                             "router_aux_loss_coef=0.")
        token_mask = attention_mask
        if attention_mask is None:
            if position_ids is not None and bool((position_ids.diff(dim=-1) < 0).any()):
                raise ValueError("packed rows (several sequences in one row) are not supported with backend='megatron'; "
                                 "turn padding_free off.")
            attention_mask = torch.ones_like(input_ids)
        if position_ids is None:
            position_ids = position_ids_from_mask(attention_mask)
        tgt = targets if select.dtype != torch.bool else targets[select]
        plan = Plan(input_ids, position_ids, attention_mask_4d(attention_mask), lambda _: None, head_rows=select,
                    token_mask=token_mask, router_logits=[] if with_aux_loss else None)

        def finish(_output):
            stats = self._head_stats(plan.head_hidden, tgt, chunk_size=chunk_size, temperature=temperature,
                                     with_entropy=with_entropy, with_log_sum_sq=with_log_sum_sq,
                                     with_mean_logit=with_mean_logit)
            if with_aux_loss:
                stats.aux_loss = self._aux_loss(plan)
            return stats

        plan.finish = finish
        return plan

    def _values_plan(self, input_ids, select, attention_mask, position_ids) -> Plan:
        if self._kind != "value":
            raise ValueError(f"the {self.role} is a causal LM; values come from a critic (a value model).")
        self._check_length(input_ids.shape[1])
        attention_mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        position_ids = position_ids_from_mask(attention_mask) if position_ids is None else position_ids
        return Plan(input_ids, position_ids, attention_mask_4d(attention_mask),
                    lambda out: out[..., 0][select].float())

    def _tp_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.dims.tp == 1:
            return t
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

        return reduce_from_tensor_model_parallel_region(t)

    def _tp_max(self, t: torch.Tensor) -> torch.Tensor:
        if self.dims.tp > 1:
            t = t.clone()
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._ps.get_tensor_model_parallel_group())
        return t

    def _plan(self, request: ForwardRequest, batch: Any) -> Plan | None:
        """The plan of a request this engine serves itself (None: run the request on the primitives)."""
        if isinstance(request, LogProbs):
            ids, mask, select, targets = rollout_positions(batch)
            plan = self._stats_plan(ids, targets, select, mask, None, with_entropy=request.with_entropy,
                                    temperature=request.temperature if request.temperature > 0 else 1.0,
                                    chunk_size=request.chunk_size, with_aux_loss=request.with_aux_loss)
            if self.router_replay:
                plan.replay = self._replay_record(batch)
            if self._arch.is_moe and self.dims.pp == 1:  # routing metrics (every MoE layer on this stage)
                plan.routing, plan.routing_mask = [], mask.bool()
            stats = plan.finish
            plan.finish = lambda out: PolicyOutput(
                logp=scatter_completion(batch, (s := stats(out)).logp),
                entropy=scatter_completion(batch, s.entropy) if request.with_entropy else None, aux_loss=s.aux_loss,
                routing=self._routing_metrics(plan))
            return plan
        if isinstance(request, SamplingStatistics):
            ids, mask, select, targets = rollout_positions(batch)
            plan = self._stats_plan(ids, targets, select, mask, None, with_log_sum_sq=True,
                                    temperature=request.temperature if request.temperature > 0 else 1.0,
                                    chunk_size=request.chunk_size)
            stats = plan.finish
            plan.finish = lambda out: (scatter_completion(batch, (s := stats(out)).logp),
                                       scatter_completion(batch, s.log_sum_sq.exp()))
            return plan
        if isinstance(request, Values):
            ids, mask, select, _ = rollout_positions(batch)
            plan = self._values_plan(ids, select, mask, None)
            values = plan.finish
            plan.finish = lambda out: scatter_completion(batch, values(out))
            return plan
        query = request.token_query(self, batch) if hasattr(request, "token_query") else None
        if query is not None:  # one token_logprobs call and a reduction (DPO's pairs): schedulable
            plan = self._stats_plan(query.input_ids, query.targets, query.select, query.attention_mask,
                                    query.position_ids, temperature=query.temperature,
                                    with_entropy=query.with_entropy, with_log_sum_sq=query.with_log_sum_sq,
                                    with_mean_logit=query.with_mean_logit, chunk_size=query.chunk_size,
                                    with_aux_loss=query.with_aux_loss)
            stats = plan.finish
            plan.finish = lambda out: request.from_stats(stats(out), batch)
            return plan
        return None

    def _whole_model(self, what: str) -> None:
        if self.dims.pp > 1:
            raise ValueError(f"{what} runs the whole model in one call, which a pipeline of "
                             f"{self.dims.pp} stages cannot: use a request the Megatron engine schedules (LogProbs, "
                             "Values, SamplingStatistics), or pipeline_model_parallel_size=1.")

    def token_logprobs(self, input_ids, targets, select, *, attention_mask=None, position_ids=None, temperature=1.0,
                       chunk_size=1024, with_entropy=False, with_mean_logit=False, with_aux_loss=False,
                       with_log_sum_sq=False) -> TokenStats:
        self._whole_model("token_logprobs")
        plan = self._stats_plan(input_ids, targets, select, attention_mask, position_ids, temperature=temperature,
                                with_entropy=with_entropy, with_log_sum_sq=with_log_sum_sq,
                                with_mean_logit=with_mean_logit, chunk_size=chunk_size, with_aux_loss=with_aux_loss)
        return plan.finish(self._run(plan))

    def token_values(self, input_ids, select, *, attention_mask=None, position_ids=None) -> torch.Tensor:
        self._whole_model("token_values")
        plan = self._values_plan(input_ids, select, attention_mask, position_ids)
        return plan.finish(self._run(plan))

    def logprobs(self, batch: RolloutBatch, *, temperature: float = 1.0, chunk_size: int = 1024,
                 with_entropy: bool = False, with_aux_loss: bool = False):
        self._whole_model("logprobs")
        plan = self._plan(LogProbs(temperature, chunk_size, with_entropy, with_aux_loss), batch)
        out = plan.finish(self._run(plan))
        self._last_routing = out.routing
        return (out.logp, out.entropy, out.aux_loss) if with_aux_loss else (out.logp, out.entropy)

    def take_routing_metrics(self) -> dict[str, float]:
        """The routing metrics of the last :meth:`logprobs` forward of an MoE model, then cleared."""
        out, self._last_routing = getattr(self, "_last_routing", {}), {}
        return out

    def sampling_statistics(self, batch: RolloutBatch, *, temperature: float = 1.0,
                            chunk_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
        self._whole_model("sampling_statistics")
        plan = self._plan(SamplingStatistics(temperature, chunk_size), batch)
        return plan.finish(self._run(plan))

    def values(self, batch: RolloutBatch) -> torch.Tensor:
        self._whole_model("values")
        plan = self._plan(Values(), batch)
        return plan.finish(self._run(plan))
