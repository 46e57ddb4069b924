"""Token-level streaming of the rollout server: one delta per choice per decoded token, as vLLM streams.

With a :class:`~hf_verl.rollout.hf_engine.TransformersEngine` on its lean decode loop (the default), the
stream decodes token by token itself: one left-padded prefill of every row (prompts x `n`), then one
KV-cached forward per step, tokens picked by :func:`~hf_verl.rollout.sampling.sample_next` with the request's
sampling and seed, as the engine's loop does. A choice ends, as in the engine, at an end-of-sequence token, at
the first token whose text completes a stop string (kept in the text), or at `max_tokens`; the step's delta
goes out before the next step runs. The engine's `generate` has no per-token hook, so this loop mirrors it
(`_decode_steps`); greedy choices equal the engine's, other choices follow the same distribution.

Engines that cannot be stepped (vLLM, a model with its own `generate`, `use_generate=True`) generate whole
completions, which are then sent as the same per-token chunks: the format is the same, the first chunk just
comes later.

Text deltas are detokenized incrementally (vLLM's prefix / read offsets), holding back a token whose text is
an incomplete character; their concatenation is the choice's text.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence

import torch

from hf_verl.rollout.base import (
    FINISH_LENGTH,
    FINISH_STOP,
    RolloutEngine,
    SamplingParams,
)
from hf_verl.serve.errors import error_body
from hf_verl.serve.responses import Delta, dumps

logger = logging.getLogger(__name__)


class IncrementalText:
    """The text of a growing completion, one token at a time (`skip_special_tokens`, as the whole decode)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix = self._read = 0

    def push(self, token_id: int) -> str:
        """Add a token; return the text it completes ("" while a character is incomplete)."""
        self.ids.append(token_id)
        before = self.tokenizer.decode(self.ids[self._prefix : self._read], skip_special_tokens=True)
        after = self.tokenizer.decode(self.ids[self._prefix :], skip_special_tokens=True)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        piece = after[len(before) :]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += piece
        return piece

    def flush(self) -> str:
        """The text still held back, once the completion has ended."""
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if not full.startswith(self.text):
            logger.debug("incremental text %r is not a prefix of the whole text %r", self.text, full)
            return ""
        rest = full[len(self.text) :]
        self.text = full
        return rest

    def completes(self, piece: str, stops: Sequence[str]) -> bool:
        """Whether the text just added (`piece`) completes one of `stops`."""
        return bool(piece) and any(s in self.text[-(len(piece) + len(s) - 1) :] for s in stops)


class ChoiceStates:
    """Per-choice text, token count and end of one streamed request."""

    def __init__(self, tokenizer, rows: int, sampling: SamplingParams, eos_token_ids=()) -> None:
        self.sampling, self.eos = sampling, set(eos_token_ids)
        self.texts = [IncrementalText(tokenizer) for _ in range(rows)]
        self.counts = [0] * rows
        self.done = [False] * rows

    def advance(self, row: int, token: int | None, logprob: float | None, finish: str | None = None,
                detect: bool = True) -> Delta:
        """Add `token` to choice `row`; with `detect`, decide whether it ends the choice (else `finish` says)."""
        text = self.texts[row]
        piece = "" if token is None else text.push(token)
        self.counts[row] += token is not None
        if detect:
            if token in self.eos or (self.sampling.stop and text.completes(piece, self.sampling.stop)):
                finish = FINISH_STOP
            elif self.counts[row] >= self.sampling.max_new_tokens:
                finish = FINISH_LENGTH
        if finish:
            self.done[row] = True
            piece += text.flush()
        return Delta(row, token, logprob, piece, finish)


def steppable(engine: RolloutEngine) -> bool:
    """Whether `engine` can be decoded token by token here (see the module docstring)."""
    from hf_verl.rollout.hf_engine import TransformersEngine, _own_generate

    # the engine's own test of a model-specific `generate`, which its lean loop (and this one) would bypass
    return isinstance(engine, TransformersEngine) and not engine.use_generate and not _own_generate(engine.model)


def _decode_steps(engine, prompts: list[list[int]], sampling: SamplingParams,
                  done: list[bool]) -> Iterator[tuple[list[int], list[float]]]:
    """Each step's token and log-prob for every row; rows marked in `done` are fed padding and ignored."""
    from torch.nn.utils.rnn import pad_sequence

    from hf_verl.parallel.precision import autocast
    from hf_verl.rollout.sampling import sample_next

    model = engine.model
    device = next(model.parameters()).device
    rows = [torch.tensor(p, dtype=torch.long) for p in prompts]
    ids = pad_sequence(rows, batch_first=True, padding_value=engine.pad_token_id, padding_side="left").to(device)
    mask = pad_sequence([torch.ones_like(r) for r in rows], batch_first=True, padding_side="left").to(device)
    generator = None if sampling.seed is None else torch.Generator(device).manual_seed(sampling.seed)
    penalty = sampling.repetition_penalty != 1.0
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), autocast(device, engine.autocast_dtype):
            out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=True,
                        logits_to_keep=1)
            for step in range(sampling.max_new_tokens):
                picked, lps = sample_next(out.logits[:, -1].float(), sampling, generator=generator,
                                          prev_ids=ids if penalty else None, prev_mask=mask if penalty else None)
                yield picked.tolist(), lps.tolist()
                if step + 1 == sampling.max_new_tokens or all(done):
                    return
                running = torch.tensor([not d for d in done], device=device)
                picked = torch.where(running, picked, engine.pad_token_id)
                mask = torch.cat([mask, mask.new_ones((len(rows), 1))], dim=-1)
                if penalty:
                    ids = torch.cat([ids, picked[:, None]], dim=-1)
                position_ids = position_ids[:, -1:] + 1
                out = model(input_ids=picked[:, None], attention_mask=mask, position_ids=position_ids,
                            past_key_values=out.past_key_values, use_cache=True, logits_to_keep=1)
    finally:
        if was_training:
            model.train()


def stepped_deltas(engine, lock: threading.Lock, tokenizer, prompts: list[list[int]], sampling: SamplingParams,
                   cancel: threading.Event) -> Iterator[tuple[list[Delta], int]]:
    """Decode token by token under `lock`; yield each step's deltas with the weight version."""
    states = ChoiceStates(tokenizer, len(prompts), sampling, engine.eos_token_ids)
    with lock:
        version = engine.weight_version
        with contextlib.closing(_decode_steps(engine, prompts, sampling, states.done)) as steps:
            for ids, lps in steps:
                yield [states.advance(row, ids[row], lps[row]) for row in range(len(prompts))
                       if not states.done[row]], version
                if cancel.is_set():
                    return


def whole_deltas(generate: Callable, tokenizer, prompts: list[list[int]],
                 sampling: SamplingParams) -> Iterator[tuple[list[Delta], int]]:
    """Generate whole completions with `generate(prompts, sampling)`, then yield them as per-token deltas."""
    out = generate(prompts, sampling)
    states = ChoiceStates(tokenizer, len(prompts), sampling)
    rows = list(zip(out.completion_ids, out.logprobs, out.finish_reasons))
    for step in range(max([1] + [len(ids) for ids, _, _ in rows])):
        deltas = []
        for row, (ids, lps, reason) in enumerate(rows):
            if step < len(ids) or (step == 0 and not ids):
                last = step >= len(ids) - 1
                token, logprob = (ids[step], lps[step]) if ids else (None, None)
                deltas.append(states.advance(row, token, logprob, reason if last else None, detect=False))
        yield deltas, out.weight_version


async def server_sent_events(produce: Callable[[threading.Event], Iterator[dict]]) -> AsyncIterator[bytes]:
    """Run `produce(cancel)` in a thread and send each payload it yields as an event, then `[DONE]`.

    A failure mid-stream is sent as an `{"error": ...}` event before `[DONE]`. When the client goes away,
    `cancel` is set, and a stepped decode stops after its current step.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    cancel = threading.Event()

    def put(item) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody is listening
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def work() -> None:
        try:
            for payload in produce(cancel):
                put(payload)
                if cancel.is_set():
                    break
        except Exception as err:  # reported to the client in the stream
            logger.exception("streamed generation failed")
            put(error_body(500, f"{type(err).__name__}: {err}"))
        finally:
            put(None)

    threading.Thread(target=work, name="hf-verl-serve-stream", daemon=True).start()
    try:
        while (item := await queue.get()) is not None:
            yield b"data: " + dumps(item) + b"\n\n"
        yield b"data: [DONE]\n\n"
    finally:
        cancel.set()
