"""`MegatronWeights`: the weights part of the Megatron engine: HF weights in and out, and checkpoints.

In: the role's HF state dict is converted once, through the bridge (:mod:`~hf_verl.parallel.megatron.bridge`,
:mod:`~hf_verl.parallel.megatron.families`), into this rank's shards (its tensor-parallel slice of its pipeline
stage), checked name by name and shape by shape (:meth:`MegatronWeights._load_hf`, also
:meth:`~MegatronWeights.load_full_state_dict`). Out: :meth:`~MegatronWeights.export_weights` streams HF-named
tensors bucket by bucket (tensor-parallel slices gathered per parameter, pipeline stages broadcast in turn), which
is the weight sync to a rollout engine, `save_model` and :meth:`~MegatronWeights.save_pretrained`.
:meth:`~MegatronWeights.save_checkpoint` / :meth:`~MegatronWeights.load_checkpoint` keep each rank's shards and
optimizer state, resumable on the same layout. No rank holds the whole model, so there is none to generate with or
share: a rollout engine is a replica synced by export.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from hf_verl.engine.parts.weights import WeightsEngine
from hf_verl.parallel.megatron.bridge import Bridge, Mapping, VocabColumn
from hf_verl.parallel.megatron.compat import cpu_compat


class MegatronWeights(WeightsEngine):
    """The weights part on Megatron-Core (see the module docstring); mixed into
    :class:`~hf_verl.engine.megatron.engine.MegatronEngine`, which sets what it reads: `_stage`, `_bridge`, `_ctx`,
    `_arch`, `_kind`, `_hf_config`, `_ps`, `_tp_rank`, `_pp_rank` and `_optimizer`."""

    def _load_hf(self, stage: torch.nn.Module, hf_state: dict[str, torch.Tensor]) -> None:
        """`hf_state` (whole, HF-named) into `stage` as this rank's shards, through the bridge: every stage parameter
        set, each of the shape the stage holds; tensor-parallel parameters marked as Megatron's initialisation
        would."""

        def get(name: str) -> torch.Tensor:
            if name not in hf_state:
                raise KeyError(f"the {self.role} model has no tensor {name!r}, which the "
                               f"{self._arch.family.name} bridge table maps; is it a {self._arch.family.name} model?")
            return hf_state[name].detach().to("cpu", torch.float32)

        shards = self._bridge.load(get)
        own = stage.state_dict()
        if "output_layer.weight" in own and "output_layer.weight" not in shards and self._arch.tied:
            # a tied head on a later pipeline stage than the embedding: Megatron keeps a copy there (its gradient
            # summed with the embedding's in finalize_model_grads); it starts as the embedding, and is not exported
            shards["output_layer.weight"] = VocabColumn(("model.embed_tokens.weight",)).shard(
                [get("model.embed_tokens.weight")], self._ctx)
        for name, tensor in shards.items():
            if name not in own:
                raise KeyError(f"the Megatron stage has no parameter {name!r} (bridge table and model disagree).")
            if tuple(own[name].shape) != tuple(tensor.shape):
                raise ValueError(f"{name}: the bridge made {tuple(tensor.shape)}, the stage holds {tuple(own[name].shape)}.")
        missing = [k for k in own if k not in shards and not k.endswith("_extra_state")]
        if missing:
            raise KeyError(f"the bridge table leaves Megatron parameters unset: {missing[:5]}")
        stage.load_state_dict(shards, strict=False)
        # Megatron reads a parameter's split from attributes its initialisation sets (skipped: the weights come
        # from the bridge); its gradient norm counts a tensor-parallel duplicate once by them
        params = dict(stage.named_parameters())
        entries = list(self._bridge.parameters())  # expert templates expanded over this rank's experts
        if "output_layer.weight" in shards and "output_layer.weight" not in dict(entries):
            entries.append(("output_layer.weight", VocabColumn(("model.embed_tokens.weight",))))
        for name, mapping in entries:
            if name in params and mapping.tensor_parallel:
                param = params[name]
                param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, mapping.partition_dim, 1

    @property
    def holds_full_weights(self) -> bool:
        return False

    def shares_weights_with(self, module: Any) -> bool:
        return False

    def state_dict_keys(self) -> tuple[set[str], set[str]]:
        """The HF names of the whole model (every stage) and the tied head's name."""
        whole = Bridge(self._bridge.table, self._ctx, layer_offset=0, num_layers=self._arch.num_layers,
                       first_stage=True, last_stage=True)
        tied = {"lm_head.weight"} if self._arch.tied and self._kind == "causal_lm" else set()
        return set(whole.hf_names()), tied

    def mix_weights_from(self, source: WeightsEngine, alpha: float) -> None:
        raise ValueError("sync_ref_model (mixing the policy into the reference) is not available with "
                         "backend='megatron' yet; set sync_ref_model=False.")

    def rollout_model(self) -> torch.nn.Module:
        raise ValueError("a Megatron engine holds shards, not an HF model to generate with: generate on a replica "
                         "synced by export_weights (the trainers and the facade do so).")

    def _gather(self, name: str, tensor: torch.Tensor, mapping: Mapping) -> list[torch.Tensor]:
        tensor = tensor.detach()
        expert = ".local_experts." in name  # an expert's slice: split over the expert tensor-parallel ranks
        size = self._ctx.expert_ctx().tp_size if expert else self.dims.tp
        if not mapping.tensor_parallel or size == 1:
            return [tensor]
        parts = [torch.empty_like(tensor) for _ in range(size)]
        group = self._ps.get_expert_tensor_parallel_group() if expert else self._ps.get_tensor_model_parallel_group()
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return parts

    def _gather_experts(self, name: str, local: list[list[torch.Tensor]], mapping: Mapping) -> list[list[torch.Tensor]]:
        """Every expert of a layer (each its expert-TP shards), in global order: this rank's `local` ones gathered
        over the expert-parallel group (rank r holds experts `r x E/ep ...`)."""
        if self._ctx.ep_size == 1:
            return local
        stacked = torch.stack([torch.stack(shards) for shards in local]).contiguous()  # [local, etp, ...]
        parts = [torch.empty_like(stacked) for _ in range(self._ctx.ep_size)]
        dist.all_gather(parts, stacked, group=self._ps.get_expert_model_parallel_group())
        return [list(expert.unbind(0)) for part in parts for expert in part.unbind(0)]

    def _export_params(self) -> dict[str, torch.Tensor]:
        """This rank's Megatron tensors the bridge exports (a LoRA engine gives its weights merged)."""
        return {k: v for k, v in self._stage.state_dict().items() if not k.endswith("_extra_state")}

    def _named_hf(self, dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
        """Every HF tensor of the model on every rank, pipeline stages in turn (collectives on every rank)."""
        yield from self._across_stages(list(self._bridge.export(self._gather, self._export_params(),
                                                                self._gather_experts)), dtype)

    def _across_stages(self, mine: list[tuple[str, torch.Tensor]],
                       dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
        """Every pipeline stage's `mine` (named tensors) on every rank, stage by stage (collectives)."""
        if self.dims.pp == 1:
            for name, t in mine:
                yield name, t if dtype is None else t.to(dtype)
            return
        group = self._ps.get_pipeline_model_parallel_group()
        ranks = dist.get_process_group_ranks(group)
        for stage, src in enumerate(ranks):
            meta = [[(n, tuple(t.shape), str(t.dtype)) for n, t in mine] if stage == self._pp_rank else None]
            dist.broadcast_object_list(meta, src=src, group=group)
            for i, (name, shape, dt) in enumerate(meta[0]):
                t = mine[i][1].contiguous() if stage == self._pp_rank else \
                    torch.empty(shape, dtype=getattr(torch, dt.replace("torch.", "")))
                dist.broadcast(t, src=src, group=group)
                yield name, t if dtype is None else t.to(dtype)

    def export_weights(self, bucket_bytes: int, *, dtype: torch.dtype | None = None,
                       **_: Any) -> Iterator[list[tuple[str, torch.Tensor]]]:
        return buckets(self._named_hf(dtype), bucket_bytes)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self._named_hf(None))

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._load_hf(self._stage, state)
        if self._optimizer is not None:  # the distributed optimizer's fp32 main copy follows the weights
            with cpu_compat():
                self._optimizer.reload_model_params()

    def save_pretrained(self, output_dir: str, **kwargs: Any) -> None:
        """The HF model (weights gathered from every shard and stage, safetensors) in `output_dir`, written by the
        main rank; call on every rank."""
        state = self.full_state_dict()
        if not self.dims.is_main:
            return
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

        auto = AutoModelForSequenceClassification if self._kind == "value" else AutoModelForCausalLM
        with torch.device("meta"):
            hf = auto.from_config(self._hf_config)
        hf.load_state_dict(state, strict=False, assign=True)
        if self._arch.tied and self._kind == "causal_lm":
            hf.tie_weights()
        hf.save_pretrained(output_dir, safe_serialization=True, **kwargs)

    def save_checkpoint(self, output_dir: str) -> None:
        """Each rank's shards (safetensors) and optimizer / schedule state, resumable on the same layout."""
        from safetensors.torch import save_file

        os.makedirs(output_dir, exist_ok=True)
        tag = self._checkpoint_tag()
        weights = {k: v.detach().contiguous() for k, v in self._stage.state_dict().items()
                   if not k.endswith("_extra_state")}
        if self.dims.dp_rank == 0 or (self._ctx.ep_size > 1 and self._ps.get_expert_data_parallel_rank() == 0):
            save_file(weights, os.path.join(output_dir, f"megatron_{self.role}_{tag}.safetensors"))
        if self._optimizer is not None:  # every rank its shard of the distributed optimizer
            state = {"optimizer": self.optimizer_state_dict(), "scheduler": self.scheduler_state_dict()}
            torch.save(state, os.path.join(output_dir, f"megatron_{self.role}_{tag}_dp{self.dims.dp_rank}_optim.pt"))
        dist.barrier()

    def _checkpoint_tag(self) -> str:
        """This rank's shard name: its TP and PP coordinates (and EP rank: expert-parallel ranks hold other experts)."""
        tag = f"tp{self._tp_rank}_pp{self._pp_rank}"
        return tag + f"_ep{self._ctx.ep_rank}" if self._ctx.ep_size > 1 else tag

    @torch.no_grad()
    def load_checkpoint(self, input_dir: str) -> None:
        from safetensors.torch import load_file

        tag = self._checkpoint_tag()
        path = os.path.join(input_dir, f"megatron_{self.role}_{tag}.safetensors")
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} is missing: the checkpoint was not written by a Megatron {self.role} on "
                                    f"tp={self.dims.tp}, pp={self.dims.pp} (resume on the layout that saved it).")
        self._stage.load_state_dict(load_file(path), strict=False)
        optim = os.path.join(input_dir, f"megatron_{self.role}_{tag}_dp{self.dims.dp_rank}_optim.pt")
        if self._optimizer is not None and os.path.exists(optim):
            state = torch.load(optim, weights_only=True)  # tensors, numbers and strings only
            self.load_optimizer_state_dict(state["optimizer"])
            self.load_scheduler_state_dict(state["scheduler"])


def buckets(pairs: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """`(name, tensor)` pairs grouped into lists of about `bucket_bytes` (a bucket closes once it reaches them)."""
    bucket, size = [], 0
    for name, t in pairs:
        bucket.append((name, t))
        size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket
