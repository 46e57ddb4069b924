"""Generation from prompts with images on the transformers engine.

The pixel inputs enter the prefill only; the decode steps after it are text (the model's KV cache holds the image
features). Decoding goes through the model's own `generate`, which computes each family's positions over image
tokens (Qwen2-VL's multimodal RoPE and its decode offsets, Gemma 3's bidirectional image attention) the way its
forward does; the log-probs are those of the raw logits `generate` returns (:mod:`hf_verl.rollout.base`'s
convention). Image tokens are never sampled (TRL suppresses them too): a sampled one would have no pixels behind
it in the training forward.

It drives a :class:`~hf_verl.rollout.hf_engine.TransformersEngine` through that engine's own helpers (left padding,
end-of-sequence post-processing, its weight lock and version), so that rows with images are padded, cut and
versioned exactly as text rows are; the engine's lean decode loop itself is text-only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from hf_verl.data.vision import collate_vision_inputs
from hf_verl.parallel.precision import autocast
from hf_verl.rollout.base import GenerationOutput, RolloutEngine, SamplingParams

IMAGE_TOKEN_FIELDS = ("image_token_id", "image_token_index", "video_token_id", "video_token_index")


def image_token_ids(config) -> list[int]:
    """The ids a vision-language config reserves for image (and video) placeholders."""
    ids = {getattr(config, f, None) for f in IMAGE_TOKEN_FIELDS}
    return sorted(int(i) for i in ids if isinstance(i, int) and i >= 0)


def generate_with_images(engine: RolloutEngine, prompt_ids: Sequence[Sequence[int]],
                         vision_inputs: Sequence[Mapping[str, torch.Tensor]], sampling: SamplingParams,
                         row_seeds: Sequence[int] | None = None) -> GenerationOutput:
    """One completion per prompt of a transformers engine (:class:`~hf_verl.rollout.hf_engine.TransformersEngine`),
    each prompt's pixel inputs in its prefill.

    With `row_seeds`, each row is generated alone from its seed (so that a row samples the same completion whichever
    rows share its batch: one process or several); `sampling.seed` seeds each chunk. Both leave the caller's random
    state as it was.

    Raises:
        TypeError: another engine (vLLM, a server). ValueError: stop strings.
    """
    from hf_verl.rollout.hf_engine import TransformersEngine

    if not isinstance(engine, TransformersEngine):
        raise TypeError(f"image prompts are generated on the transformers engine only, not {type(engine).__name__}: "
                         "set use_vllm=False and no generator URL (rollout_engine='transformers').")
    if sampling.stop:
        raise ValueError("image prompts are generated without stop strings: set stop=None.")
    if len(vision_inputs) != len(prompt_ids) or (row_seeds is not None and len(row_seeds) != len(prompt_ids)):
        raise ValueError(f"{len(vision_inputs)} rows of pixel inputs and {len(row_seeds or [])} row seeds for "
                         f"{len(prompt_ids)} prompts.")
    prompts = [list(map(int, p)) for p in prompt_ids]
    model = engine.model
    step = 1 if row_seeds is not None else engine.batch_size or max(len(prompts), 1)
    completions, logprobs, reasons = [], [], []
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), autocast(engine._device(), engine.autocast_dtype):
            for start in range(0, len(prompts), step):
                chunk = prompts[start : start + step]
                input_ids, mask = engine._left_pad(chunk)
                extra = collate_vision_inputs(vision_inputs[start : start + step], prompt_width=input_ids.shape[1],
                                              width=input_ids.shape[1], device=input_ids.device)
                seed = row_seeds[start] if row_seeds is not None else sampling.seed
                with engine._weights_lock, torch.random.fork_rng(  # a whole generate: in-flight updates wait for it
                        devices=[input_ids.device] if input_ids.is_cuda else [], enabled=seed is not None):
                    if seed is not None:
                        torch.manual_seed(int(seed))
                    generated, lps = _decode(engine, input_ids, mask, extra, sampling)
                for row, row_lps in zip(generated.tolist(), lps.tolist()):
                    ids, row_lps, reason = engine._postprocess(row, row_lps, sampling)
                    completions.append(ids)
                    logprobs.append(row_lps)
                    reasons.append(reason)
    finally:
        model.train(was_training)
    return GenerationOutput(completion_ids=completions, logprobs=logprobs, finish_reasons=reasons,
                            weight_version=engine.weight_version)


def _decode(engine, input_ids: torch.Tensor, mask: torch.Tensor, extra: dict, sampling: SamplingParams):
    """`model.generate` with the pixel inputs; `(generated ids, their log-probs)`, `(B, T)` each."""
    kwargs = dict(input_ids=input_ids, attention_mask=mask, **extra, max_new_tokens=sampling.max_new_tokens,
                  do_sample=not sampling.greedy, repetition_penalty=sampling.repetition_penalty,
                  pad_token_id=engine.pad_token_id, return_dict_in_generate=True, output_logits=True)
    if engine.eos_token_ids:
        kwargs["eos_token_id"] = sorted(engine.eos_token_ids)
    suppressed = image_token_ids(engine.model.config)
    if suppressed:
        kwargs["suppress_tokens"] = suppressed
    if not sampling.greedy:  # top_k=0 (not None): no fallback to the generation config's default
        kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                      min_p=sampling.min_p)
    out = engine.model.generate(**kwargs)
    generated = out.sequences[:, input_ids.shape[1] :]
    if generated.shape[1] == 0:
        return generated, torch.zeros_like(generated, dtype=torch.float)
    temperature = 1.0 if sampling.greedy else sampling.temperature
    logits = torch.stack(out.logits, dim=1).float()
    lps = torch.log_softmax(logits / temperature, dim=-1)
    return generated, lps.gather(-1, generated.unsqueeze(-1)).squeeze(-1)
