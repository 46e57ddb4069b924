"""Generation and scoring: prompt ids in, a scored :class:`~hf_verl.data.batch.RolloutBatch` out.

Nothing here touches a trained model, so it may run on a background thread (asynchronous
rollout). Rewards are computed on decoded text with the TRL calling convention
(`f(prompts, completions, completion_ids, **columns)`, conversational completions as assistant
messages) and returned per source, `(N, num_sources)`, NaN where a source returned None.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from hf_verl.data.batch import RolloutBatch
from hf_verl.data.prompts import is_conversational
from hf_verl.rewards.callables import score_reward_funcs
from hf_verl.rollout.base import FINISH_LENGTH, GenerationOutput, RolloutEngine, SamplingParams


def row_seeds(seed: int, round_index: int, dp_rank: int, dp_size: int, rows: int) -> list[int]:
    """One sampling seed per row of a data-parallel rank's part of rollout round `round_index`, from the
    row's place in the global round (ranks hold consecutive slices): the same global round samples the
    same completions on one process or split over several, in any front-end."""
    first = (round_index * dp_size + dp_rank) * rows
    return [seed * 1_000_003 + first + i for i in range(rows)]


def batch_from_output(prompt_ids: Sequence[Sequence[int]], prompts: Sequence[Any], out: GenerationOutput,
                      tokenizer: Any, device: torch.device | str, *, version: int | None = None,
                      batch_cls: type[RolloutBatch] = RolloutBatch) -> RolloutBatch:
    """A validated batch (of `batch_cls`) of `out`'s completions; texts and ids go to `meta` (`prompts`,
    `prompt_ids`, `completions`, `completion_ids`). `version` overrides the engine's weight version."""
    batch = batch_cls.from_lists(prompt_ids, out.completion_ids, tokenizer.pad_token_id,
                                    sampling_logprobs=out.logprobs, device=device)
    batch.is_truncated = torch.tensor([r == FINISH_LENGTH for r in out.finish_reasons], device=batch.device)
    versions = out.extra.get("weight_versions") or [out.weight_version if version is None else version] * len(
        prompt_ids)
    batch.weight_version = torch.tensor(versions, dtype=torch.long, device=batch.device)
    batch.meta.update(prompts=list(prompts), prompt_ids=[list(p) for p in prompt_ids],
                      completions=tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True),
                      completion_ids=out.completion_ids)
    return batch


def generate(engine: RolloutEngine, prompt_ids: Sequence[Sequence[int]], prompts: Sequence[Any],
             sampling: SamplingParams, tokenizer: Any, device: torch.device | str, *,
             row_seeds: Sequence[int] | None = None, version: int | None = None,
             batch_cls: type[RolloutBatch] = RolloutBatch) -> RolloutBatch:
    """Generate one completion per prompt on `engine` (see :meth:`RolloutEngine.generate`)."""
    kwargs = {} if row_seeds is None else {"row_seeds": list(row_seeds)}
    out = engine.generate(prompt_ids, sampling, **kwargs)
    return batch_from_output(prompt_ids, prompts, out, tokenizer, device, version=version, batch_cls=batch_cls)


def score_texts(reward_funcs: Sequence[Any], prompts: Sequence[Any], completions: Sequence[str],
                completion_ids: Sequence[Sequence[int]], columns: dict[str, list]) -> torch.Tensor:
    """`(N, num_sources)` scores of decoded completions (NaN where a source returned None)."""
    if prompts and is_conversational(prompts[0]):  # conversational: completions are assistant messages
        completions = [[{"role": "assistant", "content": c}] for c in completions]
    return score_reward_funcs(reward_funcs, prompts=list(prompts), completions=list(completions),
                              completion_ids=list(completion_ids), columns=columns)


def score(reward_funcs: Sequence[Any], batch: RolloutBatch, columns: dict[str, list]) -> torch.Tensor:
    """:func:`score_texts` of a generated batch, on the batch's device."""
    return score_texts(reward_funcs, batch.meta["prompts"], batch.meta["completions"],
                       batch.meta["completion_ids"], columns).to(batch.device)


def row_columns(rows: Sequence[dict], exclude: Sequence[str] = ("prompt", "input_ids")) -> dict[str, list]:
    """The dataset columns of `rows` that reward functions receive as keyword arguments."""
    return {k: [r.get(k) for r in rows] for k in rows[0] if k not in exclude} if rows else {}


def generate_scoring_as_done(engine: RolloutEngine, prompt_ids: Sequence[Sequence[int]], prompts: Sequence[Any],
                             sampling: SamplingParams, tokenizer: Any, device: torch.device | str,
                             reward_funcs: Sequence[Any], columns: dict[str, list],
                             group_size: int) -> tuple[RolloutBatch, torch.Tensor, float]:
    """Generate through `engine.generate_stream` (a server) and score each request's rows as soon as
    it returns, while later requests still generate. Requests hold whole groups, so every reward
    call sees complete groups. Returns the batch, the scores and the seconds spent scoring."""
    chunk = max(group_size, engine.prompts_per_request // group_size * group_size)
    parts, scores, reward_s = {}, {}, 0.0
    for offset, out in engine.generate_stream(prompt_ids, sampling, chunk_rows=chunk):
        t0 = time.perf_counter()
        end = offset + len(out.completion_ids)
        texts = tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True)
        part_columns = {k: v[offset:end] for k, v in columns.items()}
        scores[offset] = score_texts(reward_funcs, prompts[offset:end], texts, out.completion_ids, part_columns)
        reward_s += time.perf_counter() - t0
        parts[offset] = out
    order = sorted(parts)
    batch = batch_from_output(prompt_ids, prompts, GenerationOutput.concat([parts[o] for o in order]), tokenizer,
                              device)
    return batch, torch.cat([scores[o] for o in order]).to(batch.device), reward_s
