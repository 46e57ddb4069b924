"""`RolloutArguments`: the rollout knobs GRPOConfig and PPOConfig share (declared once).

Asynchronous rollout (`use_async_rollout`, `max_staleness`), the chunk size of log-prob scoring
and per-row sampling seeds. With `per_row_sampling_seed` every completion is sampled from its own
random stream, seeded by the run's `seed` and the row's place in the global generation round, so
the same global round gives the same completions on one process or split over several (the
transformers engine then draws token by token per row, a little slower; a server cannot honour
it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hf_verl.settings import setting_field


def _help(text: str) -> Any:
    return {"help": text}


@dataclass
class RolloutArguments:
    rollout_engine: str | None = field(default=None, metadata=_help(
        "The rollout engine by its registered name (hf_verl.rollout.register_rollout_engine): 'transformers', "
        "'vllm', 'remote', or your own. None: 'remote' for a generator URL (placement['generator'], or use_vllm=True "
        "with vllm_mode='server'), 'vllm' for use_vllm=True, else 'transformers'."))
    use_async_rollout: bool = setting_field("use_async_rollout", None, (
        "Generate the next round while this one trains (one weight version stale; off by default for TRL parity)."))
    max_staleness: int = setting_field("max_staleness", None, (
        "Most rounds of weight updates a rollout may lag behind; 0 makes use_async_rollout synchronous."))
    logprob_chunk_size: int = setting_field("logprob_chunk_size", None, (
        "Positions per chunk when scoring log-probs, at most: fewer above a 64k vocabulary, where a chunk's fp32 "
        "logits stay within 256 MiB."))
    padding_free: bool | None = field(default=None, metadata=_help(
        "Score rollouts packed padding-free (per-row causal attention; equal to the padded result to float rounding). "
        "None: pack a batch whose rows carry more padding than a per-row attention call costs (see "
        "docs/benchmarks.md#padding-free-rollouts), when the model attends with sdpa and has no sliding-window "
        "layers; True: always (an error when the model cannot); False: never."))
    shared_prefix: bool | None = field(default=None, metadata=_help(
        "Score the completions of one prompt with the prompt laid out once (a row 'prompt, completion_1, ..., "
        "completion_G' under a mask that lets each completion see the prompt and itself only; equal to the padded "
        "result to float rounding). None: when the layout's arithmetic is no more than that of the padded or "
        "packed layout it replaces (see docs/benchmarks.md#shared-prompts), the model attends with sdpa and has no "
        "sliding-window layers; True: whenever two rows share a prompt (an error when the model cannot); False: never."))
    weight_sync: str = setting_field("weight_sync", None, (
        "'auto' (delta sync to hf-verl serve, full in-process), 'full', 'delta' (only the changed elements at the "
        "engine's dtype, exactly) or 'adapter' (a LoRA actor: only the adapters move; docs/rollout.md)."))
    in_flight_weight_updates: bool = setting_field("in_flight_weight_updates", None, (
        "With use_async_rollout: weight updates land in the running generation between two decode steps (partial "
        "rollouts); every token carries its policy version and a token older than max_staleness is not trained."))
    async_rollout_depth: int = setting_field("async_rollout_depth", None, (
        "With use_async_rollout and in_flight_weight_updates: rounds generated ahead, decoded together with "
        "continuous batching (partial rollouts; docs/rollout.md). 1: one round ahead."))
    router_replay: bool = setting_field("router_replay", None, (
        "Mixture-of-Experts actors: record the experts the rollout routed each token to and route the training "
        "forwards' tokens to them (rollout routing replay; docs/moe.md). Off by default; a dense model is refused."))
    per_row_sampling_seed: bool = setting_field("per_row_sampling_seed", None, (
        "Sample each completion from its own stream seeded by (seed, its row in the global round): rollouts do not "
        "depend on how rows are split over processes."))

    def _validate_rollout(self) -> None:
        if self.rollout_engine is not None:
            from hf_verl.rollout.registry import ROLLOUT_ENGINES

            if self.rollout_engine not in ROLLOUT_ENGINES:
                raise ValueError(f"rollout_engine={self.rollout_engine!r} is not a registered rollout engine; choose "
                                 f"one of {sorted(ROLLOUT_ENGINES)}, or register yours with "
                                 "@hf_verl.rollout.register_rollout_engine(name) before building the config.")
        if self.per_row_sampling_seed and getattr(self, "use_vllm", False) and getattr(self, "vllm_mode", "") == "server":
            raise ValueError("per_row_sampling_seed cannot be honoured by a server (rows are batched into "
                             "requests): turn it off, or use vllm_mode='colocate'.")
