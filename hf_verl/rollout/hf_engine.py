"""A :class:`~hf_verl.rollout.base.RolloutEngine` backed by plain transformers models.

The simplest engine: it runs generation on the very model object the trainer optimises (or on a
separate copy that receives weights through :meth:`TransformersEngine.sync_weights`). It is slow
compared to vLLM but has no extra dependencies and is exact, which makes it the reference engine
for tests.

Two decode paths. By default a lean KV-cached loop (left-padded prefill, then one forward per
token with :mod:`hf_verl.rollout.sampling` picking tokens), which avoids ``generate``'s per-token
logits-processor, stopping-criteria and bookkeeping overhead that dominates for small models. The
loop reimplements transformers' ``GenerationMixin.generate`` only, so ``model.generate`` is used
when the model has a ``generate`` of its own (custom code from the Hub, a subclass, one set on the
instance), when stop strings are set, or always with ``use_generate=True``; a ``generate`` that
returns bare token ids (no logits) gets its log-probs from one teacher-forced forward.

Log-probs follow the convention of :mod:`hf_verl.rollout.base`: each sampled token's
log-probability under ``log_softmax(raw_logits / temperature)`` (temperature 1 for greedy), computed
from the raw logits (before top-k, top-p, min-p or the repetition penalty); with ``generate`` those
are the ones it returns with ``output_logits=True``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterable, Sequence

import torch

from hf_verl.moe.routing import NOT_ROUTED, RoutingTap
from hf_verl.parallel.precision import autocast
from hf_verl.parallel.weight_delta import DELTA_INDEX, DELTA_VALUE, apply_sparse
from hf_verl.rollout.base import (
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationOutput,
    RolloutEngine,
    SamplingParams,
)
from hf_verl.rollout.direct_decode import DirectDecoder, unsupported_reason
from hf_verl.rollout.sampling import sample_next

logger = logging.getLogger(__name__)


def _takes_prepared_mask(model) -> bool:
    """Whether a decode step may pass `model` a 4-D boolean key mask: sdpa attention, no sliding-window layers."""
    from hf_verl.parallel.ulysses import packing_unsupported

    return packing_unsupported(model) is None


def _own_generate(model) -> bool:
    """Whether `model.generate` is the model's own code rather than transformers' `GenerationMixin.generate`
    (which the lean loop reproduces): one set on the instance, or a class that overrides it. PEFT's
    wrapper, which hands over to the base model's, counts as the base model's."""
    from transformers import GenerationMixin

    if "generate" in vars(model):
        return True
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    if base is not model:
        return "generate" in vars(base) or getattr(type(base), "generate", None) is not GenerationMixin.generate
    return getattr(type(model), "generate", None) is not GenerationMixin.generate


class TransformersEngine(RolloutEngine):
    """Generation with a transformers causal LM: a lean KV-cached loop, or ``model.generate``.

    Args:
        model (`transformers.PreTrainedModel`): a causal language model.
        tokenizer (`transformers.PreTrainedTokenizerBase`): its tokenizer; used for the padding and
            end-of-sequence ids and for stop-string matching.
        batch_size (`int`, *optional*): number of prompts per ``generate`` call; `None` runs all
            prompts in one call.
        use_generate (`bool`, defaults to `False`): always decode with ``model.generate`` instead
            of the lean loop (which is used whenever no stop strings are set).
        cache_implementation (`str`, *optional*): ``model.generate``'s KV-cache kind (e.g. ``"static"``);
            setting it decodes with ``model.generate``.
        generate_kwargs (`dict`, *optional*): more ``model.generate`` arguments (any `GenerationConfig` field:
            beam search, n-gram blocking, ...); decoding then uses ``model.generate``, and the completions it
            returns are scored by one teacher-forced forward (beams and processors reorder its logits).
        autocast_dtype (`torch.dtype`, *optional*): run the model's forwards under `torch.autocast` in this
            dtype (the trainer's `bf16` on fp32 parameters); sampling and log-probs stay fp32.
        continuous_batching (`bool`, defaults to `False`): decode every call in flight in one shared loop, rows
            joining and leaving between two steps (:mod:`hf_verl.rollout.continuous`); for an engine that only
            generates (asynchronous rollout's copy of the actor, a server), where several calls overlap. `batch_size`
            then caps the rows decoded together. Calls that need `generate`, stop strings, a repetition penalty or
            routing records decode alone, one at a time.
        direct_decode (`bool`, defaults to `True`): the lean loop's decode steps compute straight from the weights of
            a Llama / Mistral / Qwen2 / Qwen3 model into caches allocated once per generation
            (:mod:`hf_verl.rollout.direct_decode`; the same logits, bit for bit); other models, and models it
            declines, run their own forward.
    """

    supports_in_flight_updates = True  # sync_weights may run while generate decodes (between two steps)

    def __init__(self, model, tokenizer, *, batch_size: int | None = None,
                 use_generate: bool = False, cache_implementation: str | None = None,
                 generate_kwargs: dict | None = None, autocast_dtype: torch.dtype | None = None,
                 continuous_batching: bool = False, direct_decode: bool = True) -> None:
        super().__init__()
        self.direct_decode = direct_decode
        self.autocast_dtype = autocast_dtype
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 or None, got {batch_size}.")
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.generate_kwargs = dict(generate_kwargs or {})
        self.use_generate = use_generate or cache_implementation is not None or bool(self.generate_kwargs)
        self.cache_implementation = cache_implementation
        # every end-of-sequence id the model declares (an end-of-turn token beside the tokenizer's EOS) ends a
        # completion, as in TRL and vLLM
        declared = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        declared = [] if declared is None else list(declared) if isinstance(declared, (list, tuple)) else [declared]
        eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
        self.eos_token_ids = {int(e) for e in eos + declared}
        pad = tokenizer.pad_token_id
        if pad is None:
            pad = min(self.eos_token_ids) if self.eos_token_ids else 0
        self.pad_token_id = int(pad)
        self._dedup_prefill = True  # one prefill per distinct prompt, while the model's cache can repeat rows
        self._prefill_rows: torch.Tensor | None = None  # the last prefill's distinct prompt of each row, if deduped
        self._decode_steps = 0  # tokens the last chunk sampled per row
        # in-flight weight updates: a sync lands between two decode steps, never inside a forward; a waiting sync
        # holds the turnstile, so the decode loop cannot take the weights again before it (the lock is not fair)
        self._weights_lock = threading.Lock()
        self._turnstile = threading.Lock()
        self._step_versions: list = []  # the policy version of the forward behind each sampled token, last chunk
        self._call_lock = threading.Lock()  # with continuous batching, calls outside the shared loop run one at a time
        self._decoder = None
        self._direct_declined: str | None = None  # the last reason the direct decoder gave (logged once)
        self.continuous_batching = False
        if continuous_batching:
            self.enable_continuous_batching()

    # ------------------------------------------------------------------ generation
    def enable_continuous_batching(self, max_rows: int | None = None) -> None:
        """Decode overlapping `generate` calls in one shared loop from now on (see the class docstring).

        Args:
            max_rows (`int`, *optional*): most rows decoded together (later ones wait for a place); default
                `batch_size`.

        Raises:
            ValueError: the model is trained (its mode and weights belong to the trainer) or its attention or cache
                cannot be re-padded row by row.
        """
        from hf_verl.rollout.continuous import ContinuousDecoder, continuous_unsupported

        if any(p.requires_grad for p in self.model.parameters()):
            raise ValueError("continuous_batching needs an engine on a model that only generates (requires_grad off: "
                             "asynchronous rollout's copy of the actor, a server); this one is trained.")
        reason = continuous_unsupported(self.model)
        if reason is not None:
            raise ValueError(f"continuous_batching is not available for {type(self.model).__name__}: {reason}.")
        if self._decoder is None:
            self._decoder = ContinuousDecoder(self, max_rows=max_rows or self.batch_size)
        self.continuous_batching = True

    def forward_context(self):
        """The context of this engine's forwards: autocast in `autocast_dtype` when set."""
        return autocast(self._device(), self.autocast_dtype)

    def _decodes_continuously(self, sampling: SamplingParams) -> bool:
        return (self.continuous_batching and not (self.use_generate or sampling.stop or self.record_routing)
                and sampling.repetition_penalty == 1.0 and not _own_generate(self.model))

    def _generate_continuous(self, prompts: list[list[int]], sampling: SamplingParams, generator) -> GenerationOutput:
        self.model.eval()  # a generation-only model (checked when continuous batching was turned on)
        tokens, lps, versions = self._decoder.submit(prompts, sampling, generator).result()
        done = [self._postprocess(t, lp, sampling) for t, lp in zip(tokens, lps)]  # as the plain loop's rows
        tokens, lps, reasons = [d[0] for d in done], [d[1] for d in done], [d[2] for d in done]
        versions = [v[: len(t)] for v, t in zip(versions, tokens)]
        extra = {"token_versions": versions} if self.tag_token_versions else {}
        return GenerationOutput(completion_ids=tokens, logprobs=lps, finish_reasons=reasons,
                                weight_version=min((v[0] for v in versions if v), default=self.weight_version),
                                extra=extra)

    def close(self) -> None:
        """Stop the continuous decode loop, if one runs (rows in flight finish first)."""
        if self._decoder is not None:
            self._decoder.close()
            self._decoder = None
            self.continuous_batching = False

    def generate(
        self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams,
        row_seeds: Sequence[int] | None = None,
    ) -> GenerationOutput:
        """Generate one completion per prompt.

        Args:
            prompt_ids (`Sequence[Sequence[int]]`): prompt token ids, one list per prompt, unpadded.
            sampling ([`SamplingParams`]): how to sample.
            row_seeds (`Sequence[int]`, *optional*): one seed per prompt (see
                :meth:`RolloutEngine.generate`); the lean decode loop only (no stop strings).

        Returns:
            [`GenerationOutput`]: completions (EOS kept, padding dropped), per-token log-probs,
            finish reasons and the weight version used.
        """
        prompts = [list(map(int, p)) for p in prompt_ids]
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt must contain at least one token.")
        # a seed draws from a private generator: reseeding torch's global one would also reset the
        # trainer's random state (dropout, shuffling), and from a background rollout thread, race it
        generator = None
        if sampling.seed is not None:
            generator = torch.Generator(self._device()).manual_seed(sampling.seed)
        if row_seeds is not None:
            if len(row_seeds) != len(prompts):
                raise ValueError(f"{len(row_seeds)} row seeds for {len(prompts)} prompts.")
            if self.use_generate or sampling.stop:
                raise NotImplementedError("per-row seeds need the lean decode loop: no stop strings, "
                                          "use_generate=False.")
            generator = [torch.Generator(self._device()).manual_seed(int(s)) for s in row_seeds]
        if self._decodes_continuously(sampling):
            return self._generate_continuous(prompts, sampling, generator)
        with self._call_lock if self.continuous_batching else contextlib.nullcontext():
            return self._generate_alone(prompts, sampling, generator)

    def _generate_alone(self, prompts: list[list[int]], sampling: SamplingParams, generator) -> GenerationOutput:
        step = self.batch_size or max(len(prompts), 1)
        completions: list[list[int]] = []
        logprobs: list[list[float]] = []
        reasons: list[str] = []
        routed: list[torch.Tensor] | None = [] if self.record_routing else None
        tap = self._routing_tap() if self.record_routing else None
        tagged = self.tag_token_versions  # in-flight updates: every token carries the weight version behind it
        token_versions: list[list[int]] = []
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), autocast(self._device(), self.autocast_dtype):
                for start in range(0, len(prompts), step):
                    chunk_gen = generator[start : start + step] if isinstance(generator, list) else generator
                    chunk = prompts[start : start + step]
                    with tap.recording() if tap is not None else contextlib.nullcontext():
                        ids, lps, rs = self._generate_chunk(chunk, sampling, chunk_gen)
                        if tap is not None:
                            routed += self._chunk_routing(tap, chunk, ids)
                    if tagged:
                        token_versions += [[int(v) for v in self._step_versions[: len(c)]] for c in ids]
                    completions += ids
                    logprobs += lps
                    reasons += rs
        finally:
            if was_training:
                self.model.train()
        return GenerationOutput(
            completion_ids=completions,
            logprobs=logprobs,
            finish_reasons=reasons,
            weight_version=self.weight_version,
            routed_experts=routed,
            extra={"token_versions": token_versions} if tagged else {},
        )

    # ------------------------------------------------------------------ routing records (routing replay)
    def _routing_tap(self) -> RoutingTap:
        tap = RoutingTap.of(self.model)
        if tap is None:
            raise ValueError(f"record_routing=True (router_replay) needs a Mixture-of-Experts model; "
                             f"{type(self.model).__name__} has no top-k routers. Set router_replay=False.")
        return tap

    def _chunk_routing(self, tap: RoutingTap, prompts: list[list[int]], completions: list[list[int]]
                       ) -> list[torch.Tensor]:
        """Each row's routing record `(len(prompt) + len(completion), layers, top_k)` from the chunk's forwards:
        the prefill (every row, or each distinct prompt once: `self._prefill_rows` maps them back) and one
        single-token forward per decode step, in order."""
        rows, width = len(prompts), max(len(p) for p in prompts)
        record = tap.take()  # (tokens of every forward, in call order, L, k)
        prefill_rows = self._prefill_rows if self._prefill_rows is not None else torch.arange(rows)
        first = prefill_rows.max().item() + 1 if self._prefill_rows is not None else rows
        head, rest = record[: first * width], record[first * width :]
        steps = max(self._decode_steps - 1, 0)  # the last sampled token is never fed back
        if rest.shape[0] != steps * rows:
            raise RuntimeError(f"routing record of {record.shape[0]} tokens is not a prefill of {first} x {width} "
                               f"and {steps} decode steps of {rows} rows: this generation (beam search, a custom "
                               "generate) cannot be recorded; decode with the lean loop or set router_replay=False.")
        prefill = head.view(first, width, *record.shape[1:])[prefill_rows.to(head.device)]
        decoded = rest.view(steps, rows, *record.shape[1:]).transpose(0, 1)
        full = torch.cat([prefill, decoded], dim=1).to(torch.int16 if tap.num_experts < 2**15 else torch.int32)
        out = []
        for i, (p, c) in enumerate(zip(prompts, completions)):
            row = full[i, width - len(p) : width + len(c)].cpu()
            if row.shape[0] < len(p) + len(c):  # the last sampled tokens were never fed back
                pad = row.new_full((len(p) + len(c) - row.shape[0], *row.shape[1:]), NOT_ROUTED)
                row = torch.cat([row, pad])
            out.append(row)
        return out

    def _device(self) -> torch.device:
        try:
            return next(self.model.parameters()).device
        except StopIteration:
            return torch.device("cpu")

    def _left_pad(self, prompts: list[list[int]]):
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            input_ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            attention_mask[i, width - len(p) :] = 1
        device = self._device()
        return input_ids.to(device), attention_mask.to(device)

    def _generate_chunk(self, prompts: list[list[int]], sampling: SamplingParams,
                        generator: torch.Generator | None = None):
        self._prefill_rows = None
        input_ids, attention_mask = self._left_pad(prompts)
        if self.use_generate or sampling.stop or _own_generate(self.model):
            # `generate` samples from the global generator: seed it inside a fork, so the caller's
            # random state is restored afterwards
            with torch.random.fork_rng(devices=[input_ids.device] if input_ids.is_cuda else [],
                                       enabled=generator is not None):
                if generator is not None:
                    torch.manual_seed(int(generator.initial_seed()))
                with self._weights_lock:  # generate runs whole: an in-flight update waits for it
                    version = self.weight_version
                    generated, token_lps = self._decode_with_generate(input_ids, attention_mask, sampling)
                self._step_versions = [version] * generated.shape[1]
        else:
            generated, token_lps = self._decode_loop(input_ids, attention_mask, sampling, generator)
        self._decode_steps = generated.shape[1]

        ids_out, lps_out, reasons = [], [], []
        for row, row_lps in zip(generated.tolist(), token_lps.tolist()):
            ids, lps, reason = self._postprocess(row, row_lps, sampling)
            ids_out.append(ids)
            lps_out.append(lps)
            reasons.append(reason)
        return ids_out, lps_out, reasons

    def _decode_loop(self, input_ids, attention_mask, sampling: SamplingParams,
                     generator: torch.Generator | None = None):
        """KV-cached decode: one prefill, then one single-token forward per step.

        Rows that emitted EOS keep emitting padding (log-prob 0); the loop ends once every row has
        finished or `max_new_tokens` is reached.

        Returns:
            `tuple[torch.LongTensor, torch.Tensor]`: generated ids and their log-probs, `(B, T)`.
        """
        batch = input_ids.shape[0]
        device = input_ids.device
        eos = torch.tensor(sorted(self.eos_token_ids), dtype=torch.long, device=device)
        pad = torch.full((batch,), self.pad_token_id, dtype=torch.long, device=device)
        unfinished = torch.ones(batch, dtype=torch.bool, device=device)
        seq, mask = input_ids, attention_mask
        needs_prev = sampling.repetition_penalty != 1.0
        step_ids, step_lps = [], []
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        with self._weights_lock:
            version = self.weight_version
            logits, cache = self._prefill(input_ids, mask, position_ids)
        self._step_versions = versions = []
        # one query per step: the mask is the keys' padding mask, handed to sdpa as it is instead of being rebuilt
        # by transformers every step (a 4-D mask is taken as prepared); other kernels and sliding windows need theirs
        prepared = _takes_prepared_mask(self.model)
        direct = self._direct_decoder(cache, mask, sampling.max_new_tokens)
        for t in range(sampling.max_new_tokens):
            next_ids, lps = sample_next(logits, sampling, generator=generator, prev_ids=seq if needs_prev else None,
                                        prev_mask=mask if needs_prev else None)
            next_ids = torch.where(unfinished, next_ids, pad)
            lps = lps.masked_fill(~unfinished, 0.0)
            step_ids.append(next_ids)
            step_lps.append(lps)
            versions.append(version)  # the weights whose forward gave this token's logits
            if eos.numel():
                unfinished = unfinished & ~torch.isin(next_ids, eos)
            if t + 1 == sampling.max_new_tokens or not bool(unfinished.any()):
                break
            mask = torch.cat([mask, mask.new_ones((batch, 1))], dim=-1)
            if needs_prev:
                seq = torch.cat([seq, next_ids[:, None]], dim=-1)
            position_ids = position_ids[:, -1:] + 1
            with self._turnstile:  # an in-flight weight update waiting here lands between two steps
                pass
            with self._weights_lock:
                version = self.weight_version
                if direct is not None:
                    logits = direct.step(next_ids, position_ids)
                    continue
                out = self.model(input_ids=next_ids[:, None], attention_mask=mask.bool()[:, None, None, :]
                                 if prepared else mask, position_ids=position_ids, past_key_values=cache,
                                 use_cache=True, logits_to_keep=1)
            logits, cache = out.logits[:, -1].float(), out.past_key_values
        return torch.stack(step_ids, dim=1), torch.stack(step_lps, dim=1)

    def _direct_decoder(self, cache, mask, max_new_tokens: int, grow: bool = False) -> DirectDecoder | None:
        """The direct decoder for the steps after this prefill (`grow`: the continuous loop's, whose rows come and
        go), or `None` when the model's forward runs them."""
        if not self.direct_decode:
            return None
        reason = unsupported_reason(self.model)
        if reason is not None:
            if self._direct_declined != reason:
                logger.info("decode steps run %s's own forward: %s", type(self.model).__name__, reason)
                self._direct_declined = reason
            return None
        return DirectDecoder(self.model, cache, mask, max_new_tokens, grow=grow)

    def _prefill(self, input_ids, mask, position_ids):
        """Prompt forward, once per distinct prompt (GRPO groups repeat each prompt): the KV cache
        and last logits are then gathered back to one row per completion.

        Returns:
            `(logits (B, V), cache)`.
        """
        width = input_ids.shape[1]
        self._prefill_rows = None
        unique, inverse = torch.unique(torch.cat([input_ids, mask], dim=-1), dim=0, return_inverse=True)
        if self._dedup_prefill and unique.shape[0] < input_ids.shape[0]:
            u_ids, u_mask = unique[:, :width], unique[:, width:]
            out = self.model(input_ids=u_ids, attention_mask=u_mask,
                             position_ids=(u_mask.cumsum(-1) - 1).clamp(min=0), use_cache=True, logits_to_keep=1)
            cache = out.past_key_values
            try:
                cache.batch_select_indices(inverse)
                self._prefill_rows = inverse
                return out.logits[inverse, -1].float(), cache
            except (AttributeError, NotImplementedError):
                # a cache whose layers cannot repeat rows (the recurrent layers of hybrid Mamba / linear-attention
                # models): prefill every row, for this and later calls
                logger.info("%s's KV cache cannot repeat rows; prompts are prefilled once per completion",
                            type(self.model).__name__)
                self._dedup_prefill = False
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                         use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].float(), out.past_key_values

    def _decode_with_generate(self, input_ids, attention_mask, sampling: SamplingParams):
        """Decode with ``model.generate`` (needed for stop strings); raw logits give the log-probs.

        Returns:
            `tuple[torch.LongTensor, torch.Tensor]`: generated ids and their log-probs, `(B, T)`.
        """
        width = input_ids.shape[1]
        kwargs = dict(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=sampling.max_new_tokens,
            do_sample=not sampling.greedy,
            repetition_penalty=sampling.repetition_penalty,
            pad_token_id=self.pad_token_id,
            return_dict_in_generate=True,
            output_logits=True,
        )
        if self.eos_token_ids:
            kwargs["eos_token_id"] = sorted(self.eos_token_ids)
        if not sampling.greedy:
            # top_k=0 (not None) so generate does not fall back to generation_config's default
            kwargs.update(
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k if sampling.top_k > 0 else 0,
                min_p=sampling.min_p,
            )
        if sampling.stop:
            kwargs.update(stop_strings=list(sampling.stop), tokenizer=self.tokenizer)
        if self.cache_implementation is not None:
            kwargs["cache_implementation"] = self.cache_implementation
        if self.generate_kwargs:
            kwargs.update(self.generate_kwargs, output_logits=False)  # scored below, teacher-forced
        out = self.model.generate(**kwargs)

        sequences = out if isinstance(out, torch.Tensor) else out.sequences
        generated = sequences[:, width:]
        temperature = 1.0 if sampling.greedy else sampling.temperature
        if generated.shape[1] == 0:
            return generated, torch.zeros_like(generated, dtype=torch.float)
        if isinstance(out, torch.Tensor) or getattr(out, "logits", None) is None:  # a custom generate: ids only
            logits = self._teacher_forced_logits(sequences, attention_mask, width)
        else:
            logits = torch.stack(out.logits, dim=1).float()  # (B, T, V), raw logits
        token_lps = torch.log_softmax(logits / temperature, dim=-1)
        return generated, token_lps.gather(-1, generated.unsqueeze(-1)).squeeze(-1)

    def _teacher_forced_logits(self, sequences, prompt_mask, width: int) -> torch.Tensor:
        """Raw logits `(B, T, V)` predicting each generated token, from one forward over prompt and completion
        (everything after the prompt is attended: log-probs past a row's end are cut off later)."""
        mask = torch.cat([prompt_mask, prompt_mask.new_ones(sequences.shape[0], sequences.shape[1] - width)], -1)
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = self.model(input_ids=sequences, attention_mask=mask, position_ids=position_ids,
                            use_cache=False).logits
        return logits[:, width - 1 : -1].float()

    def _postprocess(self, ids: list[int], lps: list[float], sampling: SamplingParams):
        """Cut after the first EOS or the first completed stop string; drop trailing padding."""
        reason = FINISH_LENGTH
        for j, tok in enumerate(ids):
            if tok in self.eos_token_ids:
                ids, lps, reason = ids[: j + 1], lps[: j + 1], FINISH_STOP
                break
        else:
            if self.pad_token_id not in self.eos_token_ids:
                # generate pads sequences that finished early (e.g. on a stop string)
                n = len(ids)
                while n > 0 and ids[n - 1] == self.pad_token_id:
                    n -= 1
                if n < len(ids):
                    ids, lps = ids[:n], lps[:n]
        if sampling.stop:
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            if any(s in text for s in sampling.stop):
                # smallest prefix whose decoded text contains a stop string
                for k in range(1, len(ids) + 1):
                    prefix = self.tokenizer.decode(ids[:k], skip_special_tokens=True)
                    if any(s in prefix for s in sampling.stop):
                        ids, lps, reason = ids[:k], lps[:k], FINISH_STOP
                        break
        return ids, lps, reason

    # ------------------------------------------------------------------ weights

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy new weights into the model by HF parameter name, then bump the weight version.

        Tensors that already are the model's own storage (a shared trainer/engine model) are
        skipped, so for a shared model this is just a version bump.

        Args:
            named_tensors (`Iterable[tuple[str, torch.Tensor]]`): (name, full tensor) pairs, with
                names as in ``model.state_dict()``.

        Raises:
            ValueError: if a name is not a parameter or buffer of the model, or a shape differs.
        """
        targets = self.model.state_dict(keep_vars=True)
        copied = seen = 0
        pending_index: dict[str, torch.Tensor] = {}  # a sparse delta's indices, until its values arrive
        with torch.no_grad(), self._turnstile, self._weights_lock:
            # streamed: a sharded actor sends one bucket at a time, so nothing here holds a second copy
            for name, tensor in named_tensors:
                if name.endswith(DELTA_INDEX):
                    pending_index[name[: -len(DELTA_INDEX)]] = tensor
                    continue
                if name.endswith(DELTA_VALUE):  # a sparse delta (hf_verl.parallel.weight_delta): changed elements
                    base = name[: -len(DELTA_VALUE)]
                    if base not in targets or base not in pending_index:
                        raise ValueError(f"sync_weights got a delta for {base!r} without its indices or for no "
                                         "parameter of the model (the weight version is unchanged).")
                    apply_sparse(targets[base], pending_index.pop(base), tensor)
                    seen += 1
                    copied += 1
                    continue
                target = targets.get(name)
                if target is None:
                    raise ValueError(f"sync_weights got an unknown parameter name {name!r} (after {seen} known "
                                     "ones, which were copied; the weight version is unchanged).")
                if tuple(target.shape) != tuple(tensor.shape):
                    raise ValueError(f"sync_weights: shape mismatch for {name!r}: model has {tuple(target.shape)}, "
                                     f"got {tuple(tensor.shape)} (the weight version is unchanged).")
                seen += 1
                if target.data_ptr() == tensor.data_ptr() and target.device == tensor.device:
                    continue
                target.data.copy_(tensor.to(device=target.device, dtype=target.dtype))
                copied += 1
            self._bump_version()  # inside the lock: a decode step sees new weights and their version together
        logger.debug("sync_weights: copied %d of %d tensors; weight_version=%d",
                     copied, seen, self.weight_version)

    # ------------------------------------------------------------------ LoRA adapters (adapter-only weight sync)
    accepts_adapters = True
    """`weight_sync="adapter"` writes a PEFT actor's adapters into this engine's own model (:meth:`sync_adapter`)."""

    def sync_adapter(self, name: str, config: dict, base: Iterable[tuple[str, torch.Tensor]] | None,
                     adapter: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Adapter-only weight sync into this engine's model (:mod:`hf_verl.rollout.adapters`), then one version bump.

        Applied between two decode steps, like :meth:`sync_weights`, so it may land in a running generation.

        Args:
            name (`str`): the adapter's name (the actor's active PEFT adapter).
            config (`dict`): its `LoraConfig` as a dict; the adapter is created from it the first time (the model is
                wrapped by PEFT if it is a plain model).
            base (`Iterable[tuple[str, torch.Tensor]]`, *optional*): the actor's base weights, unmerged, under the
                plain model's names; `None` when the model holds them already (every sync after the first).
            adapter (`Iterable[tuple[str, torch.Tensor]]`): the adapter's tensors under the PEFT model's names.

        Raises:
            ValueError: a name the model does not have, or a shape that differs.
        """
        from hf_verl.rollout.adapters import base_targets, copy_named, with_lora_adapter

        with torch.no_grad(), self._turnstile, self._weights_lock:
            base_bytes = 0 if base is None else copy_named(base_targets(self.model), base, "the base model")
            self.model = with_lora_adapter(self.model, name, config)
            adapter_bytes = copy_named(self.model.state_dict(keep_vars=True), adapter, f"adapter {name!r}")
            self._bump_version()
        logger.debug("sync_adapter: %d adapter bytes, %d base bytes; weight_version=%d", adapter_bytes, base_bytes,
                     self.weight_version)
