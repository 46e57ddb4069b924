"""The rollout round, once for both front-ends: sampling settings, prompt tokenising, row seeds, generation and
scoring into a typed :class:`Collected` result.

The TRL-style trainers (`trainers/on_policy.py`) and the role facade (`facade/`) both call
:class:`RoundCollector`; they differ only in *when* a round runs (a Trainer buffer, the user's loop), not in how
it is generated. A collector reads no trained role, so :meth:`RoundCollector.collect` may run on the background
thread of asynchronous rollout.

Settings are read live from one config object in the trainers' vocabulary (a `GRPOConfig` / `PPOConfig`, or the
facade's `TrainerConfig`, which carries the same names): `temperature`, `top_p`, `top_k`, `min_p`,
`repetition_penalty`, `stop`, `generation_kwargs` (TRL's precedence: it overrides the fields), `seed`,
`per_row_sampling_seed`, `chat_template_kwargs`, `pad_to_multiple_of`, `num_generations`; a field a config
lacks keeps the sampler's default.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hf_verl.data.batch import RolloutBatch
from hf_verl.data.prompts import pretokenized_prompts, tokenize_prompts
from hf_verl.data.vision import VisionPrompts, row_images, tokenize_vision_prompts
from hf_verl.pipeline import generation
from hf_verl.rewards.callables import RewardCallContext, combine_rewards
from hf_verl.rollout.base import (  # noqa: F401 (split_generation_kwargs: importable from here too)
    RolloutEngine,
    SamplingParams,
    apply_generation_kwargs,
    split_generation_kwargs,
)


def sampling_params(settings: Any, max_new_tokens: int) -> SamplingParams:
    """The sampling settings of a config in the trainers' vocabulary, overridden by its `generation_kwargs`."""
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=settings.temperature,
                              top_p=getattr(settings, "top_p", 1.0), top_k=getattr(settings, "top_k", 0),
                              min_p=getattr(settings, "min_p", None),
                              repetition_penalty=getattr(settings, "repetition_penalty", 1.0),
                              stop=tuple(getattr(settings, "stop", None) or ()))
    known, _ = split_generation_kwargs(getattr(settings, "generation_kwargs", None))
    return apply_generation_kwargs(sampling, known)


def round_row_seeds(settings: Any, round_index: int, dp_rank: int, dp_size: int, rows: int) -> list[int] | None:
    """With `per_row_sampling_seed`, one sampling seed per row of this rank's part of round `round_index`, from the
    row's place in the global round: the same global round samples the same completions however it is split over
    ranks and whichever front-end runs it. `None` without."""
    if not getattr(settings, "per_row_sampling_seed", False):
        return None
    return generation.row_seeds(settings.seed, round_index, dp_rank, dp_size, rows)


@dataclass
class Collected:
    """One generated and scored round of a rank, before any trained role has seen it.

    Attributes:
        rows (`list[dict]`): the dataset rows (each repeated per completion), prompts included.
        batch ([`RolloutBatch`]): the completions, token ids and masks (and the engine's log-probs).
        rewards_per_func (`torch.Tensor`): `(N, num_sources)` scores, NaN where a source returned None.
        num_truncated (`int`): rows whose prompt was left-truncated to the length limit.
        timings (`dict[str, float]`): seconds spent generating (`generate`) and scoring (`reward`).
        reward_context ([`RewardCallContext`]): what the reward functions logged in this round.
    """

    rows: list[dict]
    batch: RolloutBatch
    rewards_per_func: torch.Tensor
    num_truncated: int
    timings: dict[str, float] = field(default_factory=dict)
    reward_context: RewardCallContext = field(default_factory=RewardCallContext)


class RoundCollector:
    """Tokenise, generate and score one rank's rows of a round (see the module docstring).

    Args:
        tokenizer: the actor's tokenizer (pad token set).
        reward_funcs (`list`): resolved reward sources (callables and reward-model scorers).
        settings: the live config in the trainers' vocabulary (read at every call).
        max_new_tokens (`Callable[[], int]`): the completion length limit now (GRPO's `max_completion_length`,
            PPO's `response_length`).
        prompt_limit (`Callable[[], int | None]`): the prompt length limit now (lowered when a colocated engine
            has fewer positions).
        tool_rollout ([`ToolRollout`], *optional*): multi-turn tool-calling rollouts.
        batch_cls (`type`): the batch type to build (the facade's `Rollout`).
        stream_scoring (`bool`): on a server engine (`generate_stream`) without row seeds, score each request's
            rows as it returns while later ones still generate.
        processor (*optional*): a vision-language model's processor; rows with images (`image` / `images`) are
            tokenised through it with their pixel inputs (:mod:`hf_verl.data.vision`).
    """

    def __init__(self, tokenizer: Any, reward_funcs: Sequence[Any], settings: Any, *,
                 max_new_tokens: Callable[[], int], prompt_limit: Callable[[], int | None],
                 tool_rollout: Any = None, batch_cls: type[RolloutBatch] = RolloutBatch,
                 stream_scoring: bool = True, processor: Any = None) -> None:
        self.tokenizer, self.reward_funcs, self.settings = tokenizer, list(reward_funcs), settings
        self.processor = processor
        self.max_new_tokens, self.prompt_limit = max_new_tokens, prompt_limit
        self.tool_rollout, self.batch_cls, self.stream_scoring = tool_rollout, batch_cls, stream_scoring

    def sampling(self) -> SamplingParams:
        """The sampling settings of the next round."""
        return sampling_params(self.settings, self.max_new_tokens())

    def tokenize(self, rows: Sequence[dict]):
        """Prompt token ids of `rows` (a `prompt` column, or pre-tokenised `input_ids` as in TRL's PPO datasets)
        and the prompts as the reward functions see them: `(TokenizedPrompts, prompts)`; `None` with tools (a tool
        rollout renders each prompt with its row's tools itself)."""
        if self.tool_rollout is not None:
            return None
        if self.processor is not None and any(row_images(r) is not None for r in rows):
            return tokenize_vision_prompts(rows, self.processor, self.prompt_limit(),
                                           getattr(self.settings, "chat_template_kwargs", None)), \
                [r["prompt"] for r in rows]
        if "prompt" in rows[0]:
            prompts = [r["prompt"] for r in rows]
            return tokenize_prompts(prompts, self.tokenizer, self.prompt_limit(),
                                    getattr(self.settings, "chat_template_kwargs", None)), prompts
        tok = pretokenized_prompts(rows, self.tokenizer, self.prompt_limit())
        return tok, tok.texts

    def collect(self, rows: list[dict], engine: RolloutEngine, *, device: torch.device | str,
                row_seeds: list[int] | None = None, version: int | None = None,
                trainer_state: Any = None, tokenized: tuple | None = None) -> Collected:
        """Generate one completion per row on `engine` and score it with every reward source.

        Args:
            rows (`list[dict]`): this rank's rows, each repeated per completion (groups contiguous).
            engine ([`RolloutEngine`]): where to generate.
            device: where the batch's tensors go (the actor's device).
            row_seeds (`list[int]`, *optional*): one sampling seed per row (:func:`round_row_seeds`).
            version (`int`, *optional*): the weight version to stamp on the rows (default: the engine's).
            trainer_state (*optional*): passed to reward functions as `trainer_state` (TRL's keyword).
            tokenized (`tuple`, *optional*): `rows` already tokenised by :meth:`tokenize` (on the main thread, so
                that a prompt error surfaces where the rows were handed in).
        """
        t0 = time.perf_counter()
        context = RewardCallContext(trainer_state)
        reward_funcs = context.bind(self.reward_funcs)
        columns = generation.row_columns(rows)
        sampling = self.sampling()
        pad_multiple, pad_id = getattr(self.settings, "pad_to_multiple_of", None), self.tokenizer.pad_token_id
        if self.tool_rollout is not None:  # multi-turn: the same path on every engine
            result = self.tool_rollout.generate_and_score(
                engine, rows, self.tokenizer, sampling, reward_funcs, columns, device=device, row_seeds=row_seeds,
                max_prompt_length=self.prompt_limit(), version=version, batch_cls=self.batch_cls,
                chat_template_kwargs=getattr(self.settings, "chat_template_kwargs", None),
                max_context_length=engine.max_model_len,
                max_iterations=getattr(self.settings, "max_tool_calling_iterations", None))
            return Collected(rows, result.batch.pad_to_multiple(pad_multiple, pad_id), result.rewards_per_func,
                             result.num_truncated, {"generate": result.generate_s, "reward": result.reward_s},
                             context)
        tok, prompts = tokenized if tokenized is not None else self.tokenize(rows)
        vision = tok.vision_inputs if isinstance(tok, VisionPrompts) else None
        if vision is None and self.stream_scoring and hasattr(engine, "generate_stream") and row_seeds is None:
            batch, rewards_per_func, reward_s = generation.generate_scoring_as_done(
                engine, tok.ids, prompts, sampling, self.tokenizer, device, reward_funcs, columns,
                getattr(self.settings, "num_generations", 1))
            timings = {"generate": time.perf_counter() - t0 - reward_s, "reward": reward_s}
        else:
            batch = generation.generate(engine, tok.ids, prompts, sampling, self.tokenizer, device,
                                        row_seeds=row_seeds, version=version, batch_cls=self.batch_cls,
                                        vision_inputs=vision)
            t1 = time.perf_counter()
            rewards_per_func = generation.score(reward_funcs, batch, columns)
            timings = {"generate": t1 - t0, "reward": time.perf_counter() - t1}
        return Collected(rows, batch.pad_to_multiple(pad_multiple, pad_id), rewards_per_func, tok.num_truncated,
                         timings, context)

    @torch.no_grad()
    def greedy_scores(self, batch: RolloutBatch, rows: list[dict], engine: RolloutEngine,
                      reward_weights: Sequence[float] | None) -> torch.Tensor:
        """ReMax's baseline: the combined reward of one greedy completion per distinct prompt of `batch`, `(N,)`
        (each row gets its prompt's), generated on `engine` with the round's other sampling settings."""
        keys = [tuple(p) for p in batch.meta["prompt_ids"]]
        first: dict[tuple, int] = {}
        for i, k in enumerate(keys):
            first.setdefault(k, i)
        unique = list(first.values())
        sampling = dataclasses.replace(self.sampling(), temperature=0.0)
        out = engine.generate([batch.meta["prompt_ids"][i] for i in unique], sampling)
        texts = self.tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True)
        scores = generation.score_texts(self.reward_funcs, [batch.meta["prompts"][i] for i in unique], texts,
                                        out.completion_ids, generation.row_columns([rows[i] for i in unique]))
        combined = combine_rewards(scores, reward_weights).to(batch.device)
        where = {k: j for j, k in enumerate(first)}
        return combined[torch.tensor([where[k] for k in keys], device=batch.device)]
