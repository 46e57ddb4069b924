"""`Trainer`: the role-level facade for writing the RL loop by hand.

```python
trainer = Trainer(actor_model="Qwen/Qwen2.5-0.5B", reward_model=my_reward_fn, config={"group_size": 8})
for batch in loader:
    rollout = trainer.rollout(batch)       # generate, score, reference, critic, advantages
    loss = trainer.compute_loss(rollout)   # PPO clip (+ value, KL, entropy terms)
    metrics = trainer.step(loss)           # backward, clip, optimizer steps, weight sync
```

Roles load lazily (:mod:`hf_verl.facade.roles`); settings are a validated, live
:class:`~hf_verl.facade.config.TrainerConfig`; every rollout carries a trace id through its
loss and step (:mod:`hf_verl.facade.debug`). With `use_async_rollout` (default) the next rollout
of `rollout()` / `rollouts(batches)` is generated and scored in a background thread while the
current one trains (:mod:`hf_verl.facade.prefetch`), at most `max_staleness` optimizer steps
behind; the trainer-dependent phases (reference, critic, old log-probs, advantages) run on the
main thread when a rollout is handed out, and off-policy rollouts get a truncated
importance-sampling weight on the policy loss (:mod:`hf_verl.algorithms.importance`).

Departures from verl / TRL: the KL to the reference is always a loss term (GRPO style,
`kl_estimator`, default k3), also with GAE, where TRL's PPO puts it into the token rewards; old
log-probs are always recomputed by the actor when the rollout is handed out (exact PPO ratios
whatever the engine and however stale the rollout); async rollout is on by default, where TRL's
trainers (and this package's `GRPOConfig`) default to synchronous generation.
"""

from __future__ import annotations

import importlib.util
import logging
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from hf_verl.algorithms.estimators import compute_advantages, masked_whiten, token_level_rewards
from hf_verl.algorithms.importance import importance_weights
from hf_verl.algorithms.kl import kl_penalty
from hf_verl.algorithms.policy_loss import aggregate_loss, masked_mean, ppo_clip_loss
from hf_verl.data.prompts import check_prompt_column, ensure_pad_token, is_conversational, tokenize_prompts
from hf_verl.facade.config import TrainerConfig
from hf_verl.facade.debug import (
    DEFAULT_DEBUG_FILE,
    DebugRecorder,
    TraceLogger,
    new_trace_id,
    peak_memory_mb,
    trace,
)
from hf_verl.facade.prefetch import GENERATION_SETTINGS, Generated, Pending, RolloutPrefetcher, shares_actor_weights
from hf_verl.facade.rewards import build_reward_funcs
from hf_verl.facade.roles import (
    LazyModel,
    is_peft_model,
    model_device_dtype,
    token_logprobs,
    token_values,
    vocab_size,
)
from hf_verl.facade.rollout import COLUMN_PREFIX, Rollout
from hf_verl.rewards.callables import combine_rewards, reward_func_name, score_reward_funcs
from hf_verl.rollout.base import FINISH_LENGTH, RolloutEngine, SamplingParams

logger = TraceLogger(logging.getLogger(__name__), {})
_DATASET = "dataset"  # key of `rollout()`'s own prefetch (each `rollouts()` generator has its own key)
_END = object()  # no further batch

# parallelism -> modules of hf_verl, any of which provides it
_PARALLEL_BACKENDS: dict[str, tuple[str, ...]] = {
    "tensor": ("hf_verl.parallel.tensor_parallel", "hf_verl.parallel.megatron"),
    "pipeline": ("hf_verl.parallel.pipeline", "hf_verl.parallel.megatron"),
    "sequence": ("hf_verl.parallel.ulysses",),
}


class Trainer:
    """RL post-training written as three calls per step: `rollout`, `compute_loss`, `step`.

    Args:
        actor_model (`str`, `PreTrainedModel`, `PeftModel` or [`RolloutEngine`]): the policy. A
            Hub id or path loads on first use; an engine with a `.model` (such as
            [`TransformersEngine`]) generates and its model is trained.
        critic_model (*optional*): a value model (`AutoModelForSequenceClassification`,
            `num_labels=1`, id or object), scored per token. With it the estimator is GAE.
        reward_model: a reward function `f(prompts, completions, completion_ids, **columns)`, a
            reward model (id, path or object, scored with its own tokenizer), or a list of these.
        reference_model (*optional*): the KL reference (id, path or object). Without it and with
            `kl_coef > 0`, a PEFT actor with its adapters disabled serves as the reference.
        tokenizer (*optional*): the actor's tokenizer; defaults to the engine's or the actor id's.
        dataset (*optional*): rows with a `prompt` column, drawn by `rollout()` without a batch.
        config (`TrainerConfig` or `dict`, *optional*): settings (see [`TrainerConfig`]).
        reward_tokenizer (*optional*): tokenizer of a reward model given as an object.
        reward_weights (`list[float]`, *optional*): weights of the reward sources.
        rollout_engine ([`RolloutEngine`], *optional*): generation engine for `actor_model`;
            defaults to a [`TransformersEngine`] sharing the actor's weights.

    Construction loads nothing: roles given by id are fetched the first time they are needed.
    With `use_async_rollout` (default) a background worker prefetches rollouts; `close()` stops it
    (`with Trainer(...) as trainer:` closes on exit), and it never keeps a program from exiting
    for longer than a generation in flight.
    """

    def __init__(self, actor_model: Any, critic_model: Any = None, reward_model: Any = None,
                 reference_model: Any = None, tokenizer: Any = None, dataset: Any = None,
                 config: TrainerConfig | Mapping | None = None, *, reward_tokenizer: Any = None,
                 reward_weights: Sequence[float] | None = None, rollout_engine: RolloutEngine | None = None) -> None:
        self.config = config if isinstance(config, TrainerConfig) else TrainerConfig(**dict(config or {}))
        if isinstance(actor_model, RolloutEngine):
            rollout_engine, actor_model = actor_model, getattr(actor_model, "model", None)
            if actor_model is None:
                raise ValueError(f"the actor engine {type(rollout_engine).__name__} has no `.model` to train; "
                                 "pass the model as actor_model and the engine as rollout_engine=.")
        if reward_model is None:
            raise ValueError("reward_model is required: a reward function, a reward model id/path/object, or a list.")
        place = {"device": self.config.device, "dtype": self.config.dtype}
        self.actor = LazyModel("actor", actor_model, "causal_lm", **place)
        self.critic = None if critic_model is None else LazyModel("critic", critic_model, "value", **place)
        self.reference = None if reference_model is None else LazyModel("reference", reference_model, "causal_lm",
                                                                         **place)
        for role in self._model_roles():
            role.on_load.append(lambda _role: self._check_vocab())
        self._check_vocab()
        self.reward_funcs = build_reward_funcs(reward_model, reward_tokenizer)
        self.reward_weights = reward_weights
        self._tokenizer = tokenizer
        self._engine = rollout_engine
        self.dataset = dataset
        self.debug_mode = False
        self._order: list[int] = []
        self._epoch = 0
        self._actor_opt: torch.optim.Optimizer | None = None
        self._critic_opt: torch.optim.Optimizer | None = None
        self._moves_logged: set[str] = set()
        self._loss_metrics: dict[str, Any] = {}
        self._loss_rollout: Rollout | None = None
        self.global_step = 0
        self._pending: dict[Any, Pending] = {}  # prefetched rollouts, by source (`rollout()` or a generator)
        self._prefetcher = RolloutPrefetcher()
        weakref.finalize(self, self._prefetcher.close, False)
        self._engine_step = 0  # the actor step the engine's weights are from (engines that own weights)
        self._sync_deferred = False
        self._explicit_logged = self._sync_logged = self._no_logprobs_logged = False
        self.config.add_listener(self._on_config_change)

    # ------------------------------------------------------------------ roles
    def _model_roles(self) -> list[LazyModel]:
        return [r for r in (self.actor, self.critic, self.reference) if r is not None]

    def _check_vocab(self) -> None:
        """Actor, reference and critic read the same token ids: their vocabularies must agree."""
        if not self.actor.loaded:
            return
        actor_v = vocab_size(self.actor.get())
        for role in (self.reference, self.critic):
            if role is not None and role.loaded:
                other = vocab_size(role.get())
                if None not in (actor_v, other) and actor_v != other:
                    raise ValueError(
                        f"the actor ({self.actor.name}) has a vocabulary of {actor_v} tokens but the {role.role} "
                        f"({role.name}) has {other}: the {role.role} reads the actor's token ids, so both need "
                        "the same tokenizer and embedding size."
                    )

    @property
    def model(self) -> torch.nn.Module:
        """The actor model (loaded on first access)."""
        return self.actor.get()

    @property
    def tokenizer(self):
        """The actor's tokenizer (loaded on first access when the actor was given by id)."""
        if self._tokenizer is None:
            if self._engine is not None and getattr(self._engine, "tokenizer", None) is not None:
                self._tokenizer = self._engine.tokenizer
            else:
                source = self.actor.source if isinstance(self.actor.source, str) else self.actor.name
                if not isinstance(source, str) or not source or source == type(self.model).__name__:
                    raise ValueError("the actor was given as an object without a Hub id: pass tokenizer=.")
                from transformers import AutoTokenizer

                self.actor.get()  # fails first, naming the role, when the id cannot be resolved
                self._tokenizer = AutoTokenizer.from_pretrained(source)
            ensure_pad_token(self._tokenizer)
        return self._tokenizer

    @property
    def engine(self) -> RolloutEngine:
        """The actor's rollout engine (a `TransformersEngine` on the actor's weights by default)."""
        if self._engine is None:
            from hf_verl.rollout.hf_engine import TransformersEngine

            self._engine = TransformersEngine(self.model, self.tokenizer)
        return self._engine

    def supported_parallelisms(self) -> list[str]:
        """The parallelisms that can run with this installation: "data", plus "tensor",
        "pipeline" and "sequence" for each whose hf_verl backend module exists."""
        found = ["data"]
        for name, modules in _PARALLEL_BACKENDS.items():
            if any(importlib.util.find_spec(m) is not None for m in modules):
                found.append(name)
        return found

    # ------------------------------------------------------------------ role moves and debug
    def _into(self, role: str, model: torch.nn.Module, batch: Rollout) -> Rollout:
        """`batch` on `role`'s device; a device/dtype difference from the actor is logged once."""
        device, dtype = model_device_dtype(model)
        a_device, a_dtype = model_device_dtype(self.model)
        if (device, dtype) != (a_device, a_dtype) and role not in self._moves_logged:
            self._moves_logged.add(role)
            logger.info("moving rollout tensors from actor (%s, %s) to %s (%s, %s); its outputs return to the "
                        "actor as float32 on %s", a_device, a_dtype, role, device, dtype, a_device)
        return batch if device == batch.device else batch.to(device)

    def _record(self, boundary: str, tensors: Mapping[str, Any]) -> None:
        if self.debug_mode:
            path = self.config.debug_path or DEFAULT_DEBUG_FILE
            DebugRecorder(path, logger).record(boundary, tensors, step=self.global_step)

    # ------------------------------------------------------------------ rollout
    def rollout(self, batch: Any = None) -> Rollout:
        """Generate `group_size` completions per prompt, then score them and compute advantages.

        Args:
            batch: a list of prompt strings, a list of chat-message lists, a dict of lists with a
                `prompt` key (a DataLoader batch over a `datasets.Dataset`; the other keys reach
                the reward functions), a list of row dicts, or None to draw `rollout_batch_size`
                rows from `dataset`.

        Returns:
            [`Rollout`]: prompts, completions, ids, masks, old / reference log-probs, values,
            rewards, advantages and returns, aligned and on the actor's device, with
            `rollout.metrics` and `rollout.trace_id`.

        With `use_async_rollout` (the default) and no batch, the next rollout's rows are drawn now
        and generated in the background while this one trains; the next call hands it out. An
        explicit `batch` is rolled out synchronously: use [`~Trainer.rollouts`] to prefetch batches.
        """
        if batch is None:
            return self._serve(_DATASET, lambda: self._draw(self.config.rollout_batch_size))
        trace_id = new_trace_id()
        with trace(trace_id):
            if self.config.use_async_rollout and not self._explicit_logged:
                self._explicit_logged = True
                logger.info("rollout(batch) with an explicit batch is not prefetched (synchronous); for asynchronous "
                            "rollout over your batches use `for rollout in trainer.rollouts(loader): ...`")
            return self._finish(self._generate_now(batch, trace_id))

    def rollouts(self, batches: Iterable[Any]) -> Iterator[Rollout]:
        """One [`Rollout`] per batch of `batches`, generating the next batch while the caller trains.

        Args:
            batches: an iterable of batches in any form `rollout(batch)` takes (a DataLoader, say).

        Yields:
            [`Rollout`]: as `rollout(batch)` returns it. With `use_async_rollout` the next batch is
            taken from `batches` and generated in the background as soon as a rollout is yielded;
            without it each batch is rolled out when it is asked for.

        Example:
            ```python
            for rollout in trainer.rollouts(loader):
                trainer.step(trainer.compute_loss(rollout))
            ```
        """
        iterator, key = iter(batches), object()
        try:
            while (out := self._serve(key, lambda: next(iterator, _END))) is not None:
                yield out
        finally:
            self._pending.pop(key, None)  # an early break drops the prefetch; its generation just ends

    def _prefetching(self) -> bool:
        cfg = self.config
        if cfg.use_async_rollout and cfg.max_staleness == 0 and not self._sync_logged:
            self._sync_logged = True
            logger.info("max_staleness=0: every rollout is generated synchronously with the current weights")
        return cfg.use_async_rollout and cfg.max_staleness > 0

    def _generation_settings(self) -> dict[str, Any]:
        return {k: getattr(self.config, k) for k in GENERATION_SETTINGS}

    def _serve(self, key: Any, next_batch: Callable[[], Any]) -> Rollout | None:
        """Hand out `key`'s prefetched rollout (or roll one out now), then start its next prefetch."""
        pending, generated, wait_s = self._pending.pop(key, None), None, 0.0
        if pending is None:
            batch = next_batch()
            if batch is _END:
                return None
        else:
            t0 = time.perf_counter()
            generated = pending.future.result()  # a background error is raised here, as it was raised
            wait_s, batch = time.perf_counter() - t0, pending.batch
            if not self._prefetching() or pending.settings != self._generation_settings():
                logger.info("dropping the prefetched rollout (async rollout or a generation setting changed since "
                            "it started); regenerating its %d prompts now", self._num_rows(batch))
                generated = None
            elif self.global_step - generated.weights_step > self.config.max_staleness:
                self._pending[key] = pending  # kept: a retry with a higher max_staleness uses it
                raise RuntimeError(self._staleness_message(generated.weights_step))
        if generated is None:
            generated = self._generate_now(batch, new_trace_id())
        if self._prefetching() and (nxt := next_batch()) is not _END:
            self._pending[key] = self._submit(nxt)
        generated.timings["rollout_wait"] = wait_s
        return self._finish(generated)

    def _staleness_message(self, weights_step: int) -> str:
        lag = self.global_step - weights_step
        return (f"the prefetched rollout was generated with the actor's weights of step {weights_step} and would be "
                f"used at step {self.global_step}: staleness {lag} exceeds config.max_staleness="
                f"{self.config.max_staleness}. step() ran {lag} times since the previous rollout (PPO epochs or "
                f"mini-batches?): set config.max_staleness >= {lag}, or config.use_async_rollout = False for "
                "on-policy rollouts; the next rollout() then uses (or regenerates) the same prompts.")

    @staticmethod
    def _num_rows(batch: Any) -> int:
        return len(batch["prompt"]) if isinstance(batch, Mapping) else len(batch)

    def _generate_now(self, batch: Any, trace_id: str) -> Generated:
        """Generate and score `batch` on the main thread with the actor's current weights."""
        with trace(trace_id):
            prompts, columns = self._prompts(batch)
            engine = self.engine
            if self._prefetcher.busy(engine):
                self._prefetcher.wait_idle()
            self._sync_deferred_weights()
            shared = shares_actor_weights(engine, self.model)
            prompt_ids, num_truncated = self._tokenize(prompts)
            generated = self._collect(prompts, prompt_ids, num_truncated, columns, engine, None,
                                      self.global_step if shared else self._engine_step, not shared)
        generated.out.meta["trace_id"] = trace_id
        return generated

    def _submit(self, batch: Any) -> Pending:
        """Start generating `batch` in the background (rows drawn and tokenized here, on the main thread)."""
        prompts, columns = self._prompts(batch)
        prompt_ids, num_truncated = self._tokenize(prompts)
        engine = self._prefetcher.engine_for(self.engine, self.model, self.global_step)
        if engine is self._prefetcher.copy_engine:
            sync_s = self._prefetcher.sync_copy(self.model, self.global_step)
            version, weights_step = self.engine.weight_version, self.global_step
        else:
            self._prefetcher.wait_idle()
            t0 = time.perf_counter()
            self._sync_deferred_weights()
            sync_s, version, weights_step = time.perf_counter() - t0, None, self._engine_step
        # the copy holds the actor's exact weights: only its staleness makes it off-policy
        off_policy = engine is not self._prefetcher.copy_engine and not shares_actor_weights(engine, self.model)
        future = self._prefetcher.submit(engine, self._collect_in_background, new_trace_id(), sync_s, prompts,
                                         prompt_ids, num_truncated, columns, engine, version, weights_step,
                                         off_policy)
        return Pending(batch, self._generation_settings(), future)

    def _collect_in_background(self, trace_id: str, sync_s: float, *args: Any) -> Generated:
        with trace(trace_id):
            generated = self._collect(*args)
        generated.out.meta["trace_id"] = trace_id
        generated.timings["weight_sync"], generated.prefetched = sync_s, True
        return generated

    def _collect(self, prompts: list, prompt_ids: list[list[int]], num_truncated: int, columns: dict[str, list],
                 engine: RolloutEngine, version: int | None, weights_step: int, off_policy: bool) -> Generated:
        """Generate and score: reads no trainer role, so it may run off the main thread."""
        t0 = time.perf_counter()
        out = self._generate(prompts, prompt_ids, engine, version)
        t1 = time.perf_counter()
        per_func = self._score(out, columns)
        timings = {"generate": t1 - t0, "reward": time.perf_counter() - t1}
        return Generated(out, per_func, num_truncated, weights_step, off_policy, timings)

    def _finish(self, generated: Generated) -> Rollout:
        """The trainer-dependent phases of a rollout, on the main thread with the current roles."""
        out, timings = generated.out, generated.timings
        with trace(out.meta["trace_id"]):
            t2 = time.perf_counter()
            out.ref_logprobs = self._reference_logprobs(out)
            t3 = time.perf_counter()
            out.values = self._values(out)
            t4 = time.perf_counter()
            with torch.no_grad():
                self.model.eval()
                out.old_logprobs = self._actor_logprobs(out)[0]
                self.model.train()
            t5 = time.perf_counter()
            self._advantages(out)
            staleness = self.global_step - generated.weights_step
            out.meta.update(weights_step=generated.weights_step, off_policy=generated.off_policy or staleness > 0)
            out.validate()
            timings.update(reference=t3 - t2, critic=t4 - t3, old_logprobs=t5 - t4)
            timings.setdefault("weight_sync", 0.0)
            timings.setdefault("rollout_wait", 0.0)
            m = self._rollout_metrics(out, generated.per_func, timings, generated.num_truncated)
            m.update({"rollout/staleness": staleness, "rollout/prefetched": float(generated.prefetched)})
            out.meta["metrics"] = m
            self._record("rollout->compute_loss", out.tensor_fields())
            logger.info("rollout: %d completions, reward mean %.4f, %d generated tokens, staleness %d, waited "
                        "%.2fs", out.batch_size, m["reward/mean"], out.num_completion_tokens, staleness,
                        timings.get("rollout_wait", 0.0))
        return out

    def _prompts(self, batch: Any) -> tuple[list, dict[str, list]]:
        """Prompts and columns, each prompt repeated `group_size` times (groups contiguous)."""
        if batch is None:
            batch = self._draw(self.config.rollout_batch_size)
        if isinstance(batch, Mapping):
            check_prompt_column(list(batch))
            cols = {k: (v.tolist() if isinstance(v, torch.Tensor) else list(v)) for k, v in batch.items()}
            prompts = cols.pop("prompt")
        elif isinstance(batch, Sequence) and not isinstance(batch, str) and batch and all(
                isinstance(r, Mapping) and "prompt" in r for r in batch):
            prompts = [r["prompt"] for r in batch]
            cols = {k: [r.get(k) for r in batch] for k in batch[0] if k != "prompt"}
        elif isinstance(batch, Sequence) and not isinstance(batch, str) and batch:
            prompts, cols = list(batch), {}
        else:
            raise ValueError(f"rollout() needs a non-empty list of prompts, a dict with a 'prompt' key, or None "
                             f"with a dataset; got {type(batch).__name__}.")
        G = self.config.group_size
        rep = lambda xs: [x for x in xs for _ in range(G)]  # noqa: E731
        return rep(prompts), {k: rep(v) for k, v in cols.items()}

    def _draw(self, n: int) -> list[dict]:
        if self.dataset is None:
            raise ValueError("rollout() was called without a batch and the Trainer has no dataset.")
        rows = []
        while len(rows) < n:
            if not self._order:
                g = torch.Generator().manual_seed((self.config.seed or 0) + self._epoch)
                self._order = torch.randperm(len(self.dataset), generator=g).tolist()
                self._epoch += 1
            rows.append(dict(self.dataset[self._order.pop()]))
        return rows

    def _tokenize(self, prompts: list) -> tuple[list[list[int]], int]:
        """Token ids of each (repeated) prompt and the number of distinct prompts truncated."""
        G = self.config.group_size
        unique = tokenize_prompts(prompts[::G], self.tokenizer, self.config.max_prompt_length)
        return [ids for ids in unique.ids for _ in range(G)], unique.num_truncated

    def _generate(self, prompts: list, prompt_ids: list[list[int]], engine: RolloutEngine,
                  version: int | None) -> Rollout:
        """Sample on `engine`; `version` overrides the engine's weight version (the actor copy's)."""
        cfg, tok = self.config, self.tokenizer
        sampling = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                                  top_k=cfg.top_k, seed=cfg.seed)
        device = model_device_dtype(self.model)[0]
        self._record("prompts->actor", {"prompt_ids": torch.tensor([len(p) for p in prompt_ids])})
        gen = engine.generate(prompt_ids, sampling)
        out = Rollout.from_lists(prompt_ids, gen.completion_ids, tok.pad_token_id, sampling_logprobs=gen.logprobs,
                                 device=device)
        out.is_truncated = torch.tensor([r == FINISH_LENGTH for r in gen.finish_reasons], device=device)
        versions = gen.extra.get("weight_versions") or [gen.weight_version if version is None else version] * len(
            prompt_ids)
        out.weight_version = torch.tensor(versions, dtype=torch.long, device=device)
        out.meta.update(prompts=prompts, completion_ids=gen.completion_ids,
                        completions=tok.batch_decode(gen.completion_ids, skip_special_tokens=True))
        self._record("actor->rollout", out.tensor_fields())
        return out

    def _score(self, out: Rollout, columns: dict[str, list]) -> torch.Tensor:
        for k, v in columns.items():
            out.meta[COLUMN_PREFIX + k] = v
        completions = out.completions
        if is_conversational(out.prompts[0]):
            completions = [[{"role": "assistant", "content": c}] for c in completions]
        per_func = score_reward_funcs(self.reward_funcs, prompts=out.prompts, completions=completions,
                                      completion_ids=out.meta["completion_ids"], columns=columns)
        out.rewards = combine_rewards(per_func, self.reward_weights).to(out.device)
        self._record("reward->rollout", {"rewards": out.rewards})
        return per_func

    def _actor_logprobs(self, batch: Rollout, with_entropy: bool = False):
        cfg = self.config
        return token_logprobs(self.model, batch, temperature=cfg.temperature, chunk_size=cfg.logprob_chunk_size,
                              with_entropy=with_entropy)

    @torch.no_grad()
    def _reference_logprobs(self, out: Rollout) -> torch.Tensor | None:
        cfg = self.config
        if self.reference is None:
            if cfg.kl_coef == 0.0:
                return None
            if not is_peft_model(self.model):
                raise ValueError("kl_coef > 0 needs a reference: pass reference_model= (an id, path or a frozen "
                                 "copy of the actor), or use a PEFT actor (adapters disabled serve as reference).")
            with self.model.disable_adapter():
                return self._actor_logprobs(out)[0]
        ref = self.reference.get().eval()
        moved = self._into("reference", ref, out)
        self._record("actor->reference", {"input_ids": moved.input_ids, "attention_mask": moved.attention_mask})
        lp = token_logprobs(ref, moved, temperature=cfg.temperature, chunk_size=cfg.logprob_chunk_size)[0]
        self._record("reference->rollout", {"ref_logprobs": lp})
        return lp.to(device=out.device, dtype=torch.float32)

    @torch.no_grad()
    def _values(self, out: Rollout) -> torch.Tensor | None:
        if self.critic is None:
            return None
        critic = self.critic.get().eval()
        moved = self._into("critic", critic, out)
        self._record("actor->critic", {"input_ids": moved.input_ids, "attention_mask": moved.attention_mask})
        values = token_values(critic, moved)
        critic.train()
        self._record("critic->rollout", {"values": values})
        return values.to(device=out.device, dtype=torch.float32) * out.completion_mask

    def _estimator(self) -> str:
        name = self.config.estimator
        if name == "auto":
            return "gae" if self.critic is not None else "grpo"
        if name == "gae" and self.critic is None:
            raise ValueError("estimator 'gae' needs a critic: pass critic_model=, or pick a critic-free estimator "
                             "('grpo', 'rloo', 'dr_grpo', 'reinforce_plus_plus', 'reinforce_plus_plus_baseline').")
        if name != "gae" and self.critic is not None:
            raise ValueError(f"estimator {name!r} does not use the critic; set estimator='gae' (or 'auto'), or "
                             "drop critic_model.")
        return name

    def _advantages(self, out: Rollout) -> None:
        """Fill `advantages` (and `token_rewards` / `returns`) with the configured estimator."""
        cfg, name = self.config, self._estimator()
        mask = out.completion_mask
        if name in ("gae", "reinforce_plus_plus"):
            out.token_rewards, _ = token_level_rewards(out.rewards, mask)
        adv, returns = compute_advantages(name, scores=out.rewards, token_rewards=out.token_rewards,
                                          values=out.values, mask=mask, num_generations=cfg.group_size,
                                          gamma=cfg.gamma, lam=cfg.gae_lambda)
        if name == "gae" and cfg.whiten_advantages and mask.sum() > 1:
            adv = masked_whiten(adv, mask) * mask.to(adv.dtype)
        out.advantages, out.returns = adv, returns
        self._record("advantages->rollout", {"advantages": adv, "returns": returns})

    def _rollout_metrics(self, out: Rollout, per_func: torch.Tensor, timings: dict, num_truncated: int) -> dict:
        plen = out.prompt_mask.sum(-1).float()
        clen = out.completion_mask.sum(-1).float()
        m: dict[str, Any] = {
            "trace_id": out.trace_id, "rollout/num_completions": out.batch_size,
            "rollout/prompt_length_mean": plen.mean().item(), "rollout/prompt_length_max": plen.max().item(),
            "rollout/prompts_truncated": num_truncated, "rollout/generated_tokens": int(clen.sum().item()),
            "rollout/completion_length_mean": clen.mean().item(),
            "rollout/truncated_frac": out.is_truncated.float().mean().item(),
            "reward/mean": out.rewards.mean().item(),
            "reward/std": out.rewards.std().item() if out.batch_size > 1 else 0.0,
            "advantages/mean": masked_mean(out.advantages.float(), out.completion_mask).item()
            if out.advantages.dim() == 2 else out.advantages.mean().item(),
            "memory/peak_mb": peak_memory_mb(out.device),
        }
        for j, func in enumerate(self.reward_funcs):
            m[f"reward/{reward_func_name(func)}/mean"] = per_func[:, j].nanmean().item()
        for k, v in timings.items():
            m[f"time/{k}_s"] = v
        return m

    # ------------------------------------------------------------------ loss and step
    def compute_loss(self, rollout: Rollout) -> torch.Tensor:
        """The scalar loss of `rollout` (or of a mini-batch from `rollout.split(n)`).

        PPO-clip policy loss, plus `vf_coef` x clipped value loss with a critic, `kl_coef` x KL to
        the reference, minus `entropy_coef` x entropy. Each term is in the metrics `step` returns.
        """
        cfg = self.config
        with trace(rollout.trace_id or new_trace_id()):
            self._record("rollout->actor", rollout.tensor_fields())
            self.model.train()
            mask = rollout.completion_mask

            def agg(per_token: torch.Tensor) -> torch.Tensor:
                return aggregate_loss(per_token, mask, cfg.loss_type, max_completion_length=cfg.max_new_tokens,
                                      normalizer=mask.sum().item())

            logp, entropy = self._actor_logprobs(rollout, with_entropy=True)
            per_token, clip = ppo_clip_loss(logp, rollout.old_logprobs, rollout.advantages, mask, cfg.clip_range)
            is_weights, m = self._importance_weights(rollout)
            if is_weights is not None:
                per_token = per_token * is_weights
            policy_loss = agg(per_token)
            loss = policy_loss
            m.update({"loss/policy": policy_loss.item(), "entropy": masked_mean(entropy.detach(), mask).item(),
                      "clip_ratio": masked_mean(clip["region_clip"], mask).item()})
            if cfg.kl_coef > 0:
                ref = rollout.ref_logprobs if rollout.ref_logprobs is not None else self._reference_logprobs(rollout)
                kl = agg(kl_penalty(logp, ref, cfg.kl_estimator))
                loss = loss + cfg.kl_coef * kl
                m["kl"] = kl.item()
            if cfg.entropy_coef > 0:
                loss = loss - cfg.entropy_coef * agg(entropy)
            if self.critic is not None:
                value_loss, clip_frac = self._value_loss(rollout)
                loss = loss + cfg.vf_coef * value_loss.to(loss.device)
                m.update({"loss/value": value_loss.item(), "value/clip_frac": clip_frac})
            m["loss/total"] = loss.item()
            if not torch.isfinite(loss):
                raise FloatingPointError(f"the loss is {loss.item()} (terms: {m}).")
            self._loss_metrics, self._loss_rollout = m, rollout
            logger.info("compute_loss: total %.4f, policy %.4f", m["loss/total"], m["loss/policy"])
        return loss

    def _importance_weights(self, rollout: Rollout) -> tuple[torch.Tensor | None, dict[str, Any]]:
        """Truncated IS weights of an off-policy rollout (behaviour = the engine's sampling log-probs,
        target = the actor's old log-probs) and TRL's `sampling/*` metrics; None when on-policy."""
        cfg = self.config
        if not rollout.meta.get("off_policy"):
            return None, {}
        lp, mask = rollout.sampling_logprobs, rollout.completion_mask.bool()
        if lp is None or (mask.any() and not torch.isfinite(lp[mask]).any()):
            if not self._no_logprobs_logged:
                self._no_logprobs_logged = True
                logger.info("the rollout engine returned no sampling log-probs: the importance-sampling correction "
                            "of off-policy rollouts is skipped")
            return None, {}
        weights, stats = importance_weights(rollout.old_logprobs, lp, rollout.completion_mask,
                                            cfg.importance_sampling_mode, cfg.importance_sampling_clip_min,
                                            cfg.importance_sampling_clip_max)
        return (weights.detach() if cfg.importance_sampling_correction else None), stats

    def _value_loss(self, rollout: Rollout) -> tuple[torch.Tensor, float]:
        """Clipped value loss `0.5 * max((V - R)^2, (clip(V, V_old +- eps) - R)^2)`, token mean."""
        critic = self.critic.get()
        critic.train()
        moved = self._into("critic", critic, rollout)
        values = token_values(critic, moved).float().to(rollout.device)
        old, returns, mask = rollout.values, rollout.returns, rollout.completion_mask
        eps = self.config.value_clip_range
        clipped = old + (values - old).clamp(-eps, eps)
        loss_unclipped, loss_clipped = (values - returns).square(), (clipped - returns).square()
        per_token = 0.5 * torch.max(loss_unclipped, loss_clipped)
        frac = masked_mean((loss_clipped > loss_unclipped).float(), mask).item()
        return masked_mean(per_token, mask), frac

    def _optimizers(self) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer | None]:
        cfg = self.config
        if self._actor_opt is None:
            params = [p for p in self.model.parameters() if p.requires_grad]
            self._actor_opt = torch.optim.AdamW(params, lr=cfg.actor_lr, weight_decay=cfg.weight_decay)
        if self.critic is not None and self._critic_opt is None:
            params = [p for p in self.critic.get().parameters() if p.requires_grad]
            self._critic_opt = torch.optim.AdamW(params, lr=cfg.critic_lr, weight_decay=cfg.weight_decay)
        return self._actor_opt, self._critic_opt

    def _on_config_change(self, name: str, old: Any, new: Any) -> None:
        opt = {"actor_lr": self._actor_opt, "critic_lr": self._critic_opt}.get(name)
        if opt is not None:
            for group in opt.param_groups:
                group["lr"] = new
        if name == "weight_decay":
            for opt in (self._actor_opt, self._critic_opt):
                for group in (opt.param_groups if opt is not None else []):
                    group["weight_decay"] = new
        logger.info("config.%s: %r -> %r (takes effect at the next rollout / step)", name, old, new)

    def step(self, loss: torch.Tensor) -> dict[str, Any]:
        """Backward `loss`, clip gradients, step the actor (and critic) optimizers, sync weights.

        Returns:
            `dict`: the metrics of the last `compute_loss`, of its rollout, gradient norms,
            learning rates, the engine's weight version and the trace id.
        """
        rollout = self._loss_rollout
        with trace((rollout.trace_id if rollout is not None else None) or new_trace_id()) as trace_id:
            if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
                raise ValueError("step() needs the loss tensor returned by compute_loss (with its graph).")
            self._record("compute_loss->step", {"loss": loss})
            actor_opt, critic_opt = self._optimizers()
            loss.backward()
            m: dict[str, Any] = dict(rollout.metrics) if rollout is not None else {}
            m.update(self._loss_metrics)
            m["grad_norm/actor"] = self._clip_and_step(actor_opt)
            m["lr/actor"] = actor_opt.param_groups[0]["lr"]
            if critic_opt is not None:
                m["grad_norm/critic"] = self._clip_and_step(critic_opt)
                m["lr/critic"] = critic_opt.param_groups[0]["lr"]
            self.global_step += 1
            if self._prefetcher.busy(self.engine):  # never while it generates: synced before its next generation
                self._sync_deferred = True
            else:
                self._sync_engine()
            m.update({"weight_version": self.engine.weight_version, "step": self.global_step, "trace_id": trace_id})
            self._loss_metrics, self._loss_rollout = {}, None
            logger.info("step %d: grad_norm/actor %.4f, weight_version %d", self.global_step,
                        m["grad_norm/actor"], m["weight_version"])
        return m

    def _sync_engine(self) -> None:
        """Bring the engine to the actor's weights: a version bump for an engine on the actor itself,
        else the actor's HF-named full weights streamed in buckets (PEFT adapters merged, as the
        trainers sync vLLM and servers)."""
        if shares_actor_weights(self.engine, self.model):
            self.engine.sync_weights(self.model.named_parameters())  # its own tensors: nothing is copied
        else:
            from hf_verl.rollout.weight_sync import DEFAULT_BUCKET_BYTES, iter_weight_buckets

            bucket_bytes = getattr(self.engine, "bucket_bytes", None) or DEFAULT_BUCKET_BYTES
            self.engine.sync_weights(pair for bucket in iter_weight_buckets(self.model, bucket_bytes)
                                     for pair in bucket)
        self._engine_step, self._sync_deferred = self.global_step, False

    def _sync_deferred_weights(self) -> None:
        """The weight sync `step()` deferred while a generation ran on the engine, applied now."""
        if self._sync_deferred:
            self._sync_engine()

    def close(self) -> None:
        """Stop the background rollout worker (a generation in flight finishes first), drop prefetched
        rollouts and free the actor copy. The Trainer is also a context manager that closes on exit;
        using it again after `close()` starts a new worker."""
        self._pending.clear()
        self._prefetcher.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _clip_and_step(self, opt: torch.optim.Optimizer) -> float:
        params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
        max_norm = self.config.max_grad_norm
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm is not None else float("inf"))
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(norm)
