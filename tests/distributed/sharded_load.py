"""Sharded loading against a whole load, on 2 gloo processes.

`python -m torch.distributed.run --nproc_per_node 2 -m tests.distributed.sharded_load BACKEND UNTIED TIED OUT`
(BACKEND: fsdp2 or zero3; UNTIED / TIED: checkpoint directories written by :func:`save_tiny_llama`). Each
rank loads the actor (trained), a reference (frozen; for FSDP2 the trainers' `frozen_copy` of the
pending actor) and a tied-embedding actor through `load_sharded` + `make_engine`, then the main rank
writes OUT (JSON): per case, whether the parameters are sharded, this rank's share of the elements,
the largest difference of the gathered weights from `from_pretrained`'s, and for the reference the
largest logit difference from the whole model's forward; for FSDP2 also the largest gradient difference of
one backward against the same engine over a whole load.
"""

import json
import os
import sys

import torch


def save_tiny_llama(directory: str, *, tied: bool, seed: int) -> None:
    """A 2-layer Llama with an odd vocabulary (97 rows: the two shards differ in length), saved as safetensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=97, tie_word_embeddings=tied, max_position_embeddings=64)
    LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)


def _layout(backend: str):
    from hf_verl.engine.registry import RoleLayout
    from hf_verl.parallel.backend import BackendSpec
    from hf_verl.parallel.dims import ParallelDims

    spec = BackendSpec(kind="fsdp2") if backend == "fsdp2" else BackendSpec(kind="deepspeed", zero_stage=3)
    dims = ParallelDims.data_parallel(2, torch.distributed.get_rank(), shard=True)
    return RoleLayout(backend=spec, dims=dims)


def _share(model) -> tuple[bool, float]:
    """Whether every parameter is sharded, and this rank's fraction of all parameter elements."""
    from torch.distributed.tensor import DTensor

    local = total = 0
    sharded = True
    for p in {id(p): p for p in model.parameters()}.values():
        if isinstance(p, DTensor):
            local, total = local + p.to_local().numel(), total + p.numel()
        elif hasattr(p, "ds_tensor"):
            local, total = local + p.ds_tensor.numel(), total + p.ds_numel
        else:
            sharded = False
            local, total = local + p.numel(), total + p.numel()
    return sharded, local / total


def _weight_diff(engine, whole) -> tuple[bool, float]:
    """(same names, largest absolute difference) between the engine's gathered weights and `whole`'s."""
    full = engine.full_state_dict()  # a collective; the main rank keeps the tensors
    if not engine.dims.is_main:
        return True, 0.0
    reference = whole.state_dict()
    same = set(full) == set(reference)
    diff = max(float((full[k].float() - reference[k].float()).abs().max()) for k in reference if k in full)
    return same, diff


def _case(engine, whole, directory: str) -> dict:
    sharded, share = _share(engine.model)
    same, diff = _weight_diff(engine, whole)
    return {"sharded": sharded, "share": share, "same_names": same, "weight_diff": diff,
            "attn": engine.model.config._attn_implementation == whole.config._attn_implementation}


def main(backend: str, untied: str, tied: str, out: str) -> None:
    from transformers import AutoModelForCausalLM

    from hf_verl.engine.registry import make_engine
    from hf_verl.parallel.sharded_load import load_sharded
    from hf_verl.pipeline.prefetch import frozen_copy

    torch.distributed.init_process_group("gloo")
    layout = _layout(backend)
    result = {}
    whole = AutoModelForCausalLM.from_pretrained(untied, dtype=torch.float32)

    model = load_sharded(untied, layout)
    reference_model = frozen_copy(model) if backend == "fsdp2" else load_sharded(untied, layout)
    actor = make_engine(model, "actor", layout, trainable=True)
    result["actor"] = _case(actor, whole, untied)

    reference = make_engine(reference_model, "reference", layout, trainable=False)
    result["reference"] = _case(reference, whole, untied)
    ids = torch.tensor([[1, 5, 9, 96, 3, 0, 44], [7, 7, 2, 80, 11, 13, 90]])
    with torch.no_grad():
        logits = reference.forward(input_ids=ids).logits
        expected = whole(input_ids=ids).logits
    result["reference"]["logit_diff"] = float((logits - expected).abs().max())

    if backend == "fsdp2":  # trains: the same gradients as the whole load sharded by the same engine
        loaded = make_engine(AutoModelForCausalLM.from_pretrained(untied, dtype=torch.float32), "actor", layout,
                             trainable=True)
        grads = []
        for engine in (actor, loaded):
            engine.module(input_ids=ids).logits.float().pow(2).mean().backward()
            grads.append({n: p.grad.full_tensor() for n, p in engine.model.named_parameters()})
        result["actor"]["grad_diff"] = max(float((grads[0][n] - grads[1][n]).abs().max()) for n in grads[1])

    whole_tied = AutoModelForCausalLM.from_pretrained(tied, dtype=torch.float32)
    tied_engine = make_engine(load_sharded(tied, layout), "actor", layout, trainable=True)
    result["tied"] = _case(tied_engine, whole_tied, tied)
    m = tied_engine.model
    result["tied"]["still_tied"] = m.get_output_embeddings().weight is m.get_input_embeddings().weight
    if torch.distributed.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main(*sys.argv[1:5])
