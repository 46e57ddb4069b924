"""Continuous batching for :class:`~hf_verl.rollout.hf_engine.TransformersEngine`: one decode loop shared by every
`generate` call in flight, rows joining and leaving it between two decode steps.

The plain lean loop decodes one call's rows together until the longest finishes: with long-tailed completion
lengths (most short, a few at the length limit) most steps run a handful of live rows, and a second call waits for
the first. Here one scheduler thread owns the decode loop; a call hands its prompts in and waits for its rows. At
every step the scheduler

1. admits waiting rows: one prefill of the new prompts, whose KV cache is left-padded to the running cache's width
   (or the running cache to theirs) and appended to it along the batch;
2. samples one token for every live row from its last logits (each call with its own sampling settings and random
   source: a call's per-row generators give each row the draws it gets in the plain loop);
3. retires rows that emitted an end-of-sequence token or reached their call's `max_new_tokens`, completes each
   call whose rows all finished, and trims cache columns that are padding for every remaining row;
4. runs one single-token forward for the live rows, under the engine's weights lock: an in-flight weight update
   lands between two steps, and every token records the weight version of the forward behind it.

So the rounds of asynchronous rollout generated ahead (`async_rollout_depth > 1`) share decode steps, and the long
tail of one round runs in the same forwards as the bulk of the next (partial rollouts, as in verl, slime and
NeMo-RL). The tokens a row samples depend on which other rows share its forwards only through float rounding
(batched matmuls), as between any two batch compositions; with one generator per row its random draws do not.

Needs a model whose KV cache is a list of full-attention layers (no sliding windows, no recurrent state) and sdpa
attention, the lean loop's conditions; :func:`continuous_unsupported` says why not otherwise.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from hf_verl.rollout.base import SamplingParams
from hf_verl.rollout.direct_decode import DirectDecoder, pad_left
from hf_verl.rollout.sampling import sample_next

logger = logging.getLogger(__name__)

__all__ = ["ContinuousDecoder", "continuous_unsupported", "pad_left"]


def continuous_unsupported(model) -> str | None:
    """Why `model` cannot decode with continuous batching, or `None` when it can."""
    from hf_verl.parallel.ulysses import packing_unsupported

    reason = packing_unsupported(model)
    if reason is not None:
        return reason
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if types != {"full_attention"}:
        return f"its layers are {sorted(types)}: continuous batching pads KV caches of full-attention layers only"
    return None


@dataclass
class _Call:
    """One `generate` call: its rows' prompts, sampling settings, random source and results."""

    prompts: list[list[int]]
    sampling: SamplingParams
    generator: torch.Generator | list[torch.Generator] | None
    tokens: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    versions: list[list[int]] = field(default_factory=list)
    left: int = 0  # rows not finished yet
    future: Future = field(default_factory=Future)

    def __post_init__(self) -> None:
        n = len(self.prompts)
        self.tokens, self.logprobs, self.versions = [[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)]
        self.left = n

    def row_generator(self, i: int):
        return self.generator[i] if isinstance(self.generator, list) else self.generator


@dataclass
class _Live:
    """The running decode batch: rows `(call, index)`, KV cache, key mask, positions and next-token logits."""

    rows: list[tuple[_Call, int]]
    cache: DynamicCache
    mask: torch.Tensor  # (R, W) 1 on real keys
    positions: torch.Tensor  # (R,) position of each row's last fed token
    logits: torch.Tensor  # (R, V) fp32, the next token's
    versions: list[int]  # the weight version of the forward behind each row's logits


class ContinuousDecoder:
    """The shared decode loop (see the module docstring).

    Args:
        engine ([`TransformersEngine`]): the engine whose model, end-of-sequence and padding ids, weights lock and
            weight version the loop uses.
        max_rows (`int`, *optional*): most rows decoded together; later rows wait for free places. `None`: no limit.
    """

    def __init__(self, engine, max_rows: int | None = None) -> None:
        if max_rows is not None and max_rows < 1:
            raise ValueError(f"max_rows must be >= 1 or None, got {max_rows}.")
        self.engine, self.max_rows = engine, max_rows
        self._waiting: deque[tuple[_Call, int]] = deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.steps = 0  # decode forwards run (for tests and metrics)
        self.peak_rows = 0

    # ------------------------------------------------------------------ calls
    def submit(self, prompts: list[list[int]], sampling: SamplingParams,
               generator: torch.Generator | list[torch.Generator] | None = None) -> Future:
        """Queue `prompts` (unpadded token ids); the future gives `(tokens, logprobs, versions)` per row, in order
        (each row's tokens up to and including its end-of-sequence token)."""
        if sampling.repetition_penalty != 1.0 or sampling.stop:
            raise NotImplementedError("continuous batching samples without a repetition penalty or stop strings.")
        call = _Call([list(p) for p in prompts], sampling, generator)
        if not prompts:
            call.future.set_result(([], [], []))
            return call.future
        with self._cond:
            if self._closed:
                raise RuntimeError("the continuous decoder is closed.")
            self._waiting.extend((call, i) for i in range(len(prompts)))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hf_verl-decode", daemon=True)
                self._thread.start()
            self._cond.notify()
        return call.future

    def close(self) -> None:
        """Stop the loop once the rows in flight finish (later calls are refused)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    # ------------------------------------------------------------------ the loop
    def _run(self) -> None:
        live: _Live | None = None
        while True:
            with self._cond:
                while live is None and not self._waiting:
                    if self._closed:
                        return
                    self._cond.wait()
                room = len(self._waiting) if self.max_rows is None else self.max_rows - (len(live.rows) if live else 0)
                admitted = [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
            try:
                live = self._step(live, admitted)
            except BaseException as exc:
                logger.exception("continuous decode step failed")
                failed = {id(c): c for c, _ in (live.rows if live else [])} | {id(c): c for c, _ in admitted}
                with self._cond:
                    failed |= {id(c): c for c, _ in self._waiting}
                    self._waiting.clear()
                for call in failed.values():
                    if not call.future.done():
                        call.future.set_exception(exc)
                live = None

    def _step(self, live: _Live | None, admitted: list[tuple[_Call, int]]) -> _Live | None:
        engine = self.engine
        with torch.no_grad(), engine.forward_context():
            if admitted:
                live = self._admit(live, admitted)
            self.peak_rows = max(self.peak_rows, len(live.rows))
            next_ids, keep = self._sample(live)
            if not keep.all():
                live = self._retire(live, keep)
                next_ids = next_ids[keep]
            if live is None:
                return None
            self._forward(live, next_ids)
        return live

    def _admit(self, live: _Live | None, admitted: list[tuple[_Call, int]]) -> _Live:
        engine = self.engine
        input_ids, mask = engine._left_pad([call.prompts[i] for call, i in admitted])
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        with engine._turnstile:
            pass
        with engine._weights_lock:
            version = engine.weight_version
            out = engine.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                               logits_to_keep=1)
        room = max(call.sampling.max_new_tokens for call, _ in admitted)
        cache = engine._direct_decoder(out.past_key_values, mask, room, grow=True) or out.past_key_values
        new = _Live(list(admitted), cache, mask, positions[:, -1], out.logits[:, -1].float(),
                    [version] * len(admitted))
        return new if live is None else _merge(live, new)

    def _sample(self, live: _Live) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per live row, recorded on its call; returns the tokens and which rows go on."""
        groups: dict[int, list[int]] = {}
        for r, (call, _) in enumerate(live.rows):
            groups.setdefault(id(call), []).append(r)
        next_ids = torch.empty(len(live.rows), dtype=torch.long, device=live.logits.device)
        lps = torch.empty(len(live.rows), dtype=torch.float, device=live.logits.device)
        for rows in groups.values():
            call = live.rows[rows[0]][0]
            gen = call.generator
            if isinstance(gen, list):
                gen = [gen[live.rows[r][1]] for r in rows]
            index = torch.tensor(rows, device=live.logits.device)
            ids, lp = sample_next(live.logits[index], call.sampling, generator=gen)
            next_ids[index], lps[index] = ids, lp
        keep = torch.ones(len(live.rows), dtype=torch.bool)
        eos = self.engine.eos_token_ids
        for r, (tok, lp) in enumerate(zip(next_ids.tolist(), lps.tolist())):
            call, i = live.rows[r]
            call.tokens[i].append(tok)
            call.logprobs[i].append(lp)
            call.versions[i].append(live.versions[r])
            if tok in eos or len(call.tokens[i]) >= call.sampling.max_new_tokens:
                keep[r] = False
                call.left -= 1
                if call.left == 0:
                    call.future.set_result((call.tokens, call.logprobs, call.versions))
        return next_ids, keep

    def _retire(self, live: _Live, keep: torch.Tensor) -> _Live | None:
        if not keep.any():
            return None
        index = keep.nonzero().squeeze(1).to(live.mask.device)
        direct = isinstance(live.cache, DirectDecoder)
        live.cache.select(index) if direct else live.cache.batch_select_indices(index)
        mask = live.mask[index]
        first = int((mask.sum(0) > 0).nonzero()[0])  # columns that are padding for every remaining row go
        if first:
            live.cache.trim(first) if direct else _map_layers(live.cache, lambda t: t[..., first:, :])
            mask = mask[:, first:]
        return _Live([live.rows[i] for i in index.tolist()], live.cache, mask, live.positions[index],
                     live.logits[index], [live.versions[i] for i in index.tolist()])

    def _forward(self, live: _Live, next_ids: torch.Tensor) -> None:
        engine = self.engine
        live.mask = torch.cat([live.mask, live.mask.new_ones((live.mask.shape[0], 1))], dim=-1)
        live.positions = live.positions + 1
        with engine._turnstile:  # an in-flight weight update waiting here lands between two steps
            pass
        with engine._weights_lock:
            version = engine.weight_version
            if isinstance(live.cache, DirectDecoder):
                live.logits = live.cache.step(next_ids, live.positions[:, None])
            else:
                out = engine.model(input_ids=next_ids[:, None], attention_mask=live.mask.bool()[:, None, None, :],
                                   position_ids=live.positions[:, None], past_key_values=live.cache, use_cache=True,
                                   logits_to_keep=1)
                live.cache, live.logits = out.past_key_values, out.logits[:, -1].float()
        live.versions = [version] * len(live.rows)
        self.steps += 1


def _layers(cache: DynamicCache):
    layers = getattr(cache, "layers", None)
    if layers is None or any(not hasattr(layer, "keys") or getattr(layer, "is_sliding", False) for layer in layers):
        raise NotImplementedError(f"continuous batching cannot re-pad a {type(cache).__name__} (sliding or recurrent "
                                  "layers): set continuous_batching=False.")
    return layers


def _map_layers(cache: DynamicCache, fn) -> None:
    for layer in _layers(cache):
        layer.keys, layer.values = fn(layer.keys), fn(layer.values)


def _merge(a: _Live, b: _Live) -> _Live:
    """Two decode batches as one: caches and masks left-padded to the wider, rows of `a` first."""
    if isinstance(a.cache, DirectDecoder) and isinstance(b.cache, DirectDecoder):
        return _Live(a.rows + b.rows, a.cache.merge(b.cache), torch.cat([pad_left(a.mask, b.mask.shape[1], 1),
                                                                       pad_left(b.mask, a.mask.shape[1], 1)]),
                     torch.cat([a.positions, b.positions]), torch.cat([a.logits, b.logits]), a.versions + b.versions)
    for live in (a, b):  # the model stopped qualifying for direct steps (e.g. an adapter sync): its forward runs on
        if isinstance(live.cache, DirectDecoder):
            live.cache = live.cache.to_cache()
    width = max(a.mask.shape[1], b.mask.shape[1])
    data = [(torch.cat([pad_left(la.keys, width, -2), pad_left(lb.keys, width, -2)]),
             torch.cat([pad_left(la.values, width, -2), pad_left(lb.values, width, -2)]))
            for la, lb in zip(_layers(a.cache), _layers(b.cache))]
    mask = torch.cat([pad_left(a.mask, width, 1), pad_left(b.mask, width, 1)])
    return _Live(a.rows + b.rows, DynamicCache(ddp_cache_data=data), mask, torch.cat([a.positions, b.positions]),
                 torch.cat([a.logits, b.logits]), a.versions + b.versions)
