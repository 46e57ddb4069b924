"""Run under `torchrun --nproc_per_node 2`: Ulysses sequence parallelism (sp=2) against one process.

For each model case, every rank first computes the single-process reference on the whole packed
batch (a copy of the same model with transformers' own sdpa attention, no process group involved),
then the same quantities with the sequence sharded over the two ranks: logits, token log-probs,
entropy, critic values, and the gradients of one loss built from them (summed over the sp group).
Each rank writes `rank<k>.json` into the folder argv[1] with the largest differences per case, and
the messages of the layouts that must be refused.
"""

import copy
import json
import os
import sys

import torch
import torch.distributed as dist

from hf_verl.data.packing import pack_padded
from hf_verl.parallel import ulysses
from hf_verl.parallel.comm import leave_together
from hf_verl.parallel.dims import ParallelDims

VOCAB = 61


def build(family: str, heads: int, kv_heads: int, hidden: int = 64, seed: int = 0):
    """A fp32 causal LM and a one-output value model of `family`, built in code, sdpa attention."""
    import transformers

    name = {"llama": "Llama", "qwen2": "Qwen2"}[family]
    Config, LM, Critic = (getattr(transformers, name + suffix)  # noqa: N806
                          for suffix in ("Config", "ForCausalLM", "ForSequenceClassification"))
    config = Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                    num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=128,
                    attn_implementation="sdpa", pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    actor = LM(config).float()
    config_c = copy.deepcopy(config)
    config_c.num_labels = 1
    torch.manual_seed(seed + 1)
    critic = Critic(config_c).float()
    return actor, critic


def batch():
    """Four rows (one multi-turn, with attended tool tokens not scored), 35 real tokens: odd, so the packing
    pads one token for sp=2, and rows straddle the shard boundary."""
    g = torch.Generator().manual_seed(7)
    prompts = [[int(t) for t in torch.randint(1, VOCAB, (n,), generator=g)] for n in (3, 5, 2, 4)]
    completions = [[int(t) for t in torch.randint(1, VOCAB, (n,), generator=g)] for n in (4, 2, 9, 6)]
    P, C = max(map(len, prompts)), max(map(len, completions))  # noqa: N806
    p_ids = torch.zeros(4, P, dtype=torch.long)
    p_mask = torch.zeros(4, P, dtype=torch.long)
    c_ids = torch.zeros(4, C, dtype=torch.long)
    c_attn = torch.zeros(4, C, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        p_ids[i, P - len(p):], p_mask[i, P - len(p):] = torch.tensor(p), 1
        c_ids[i, : len(c)], c_attn[i, : len(c)] = torch.tensor(c), 1
    c_mask = c_attn.clone()
    c_mask[2, 3:6] = 0  # row 2: tokens 3-5 are a tool observation, attended but not scored
    return pack_padded(p_ids, p_mask, c_ids, c_mask, completion_attention_mask=c_attn, multiple_of=2)


def loss_of(logp, entropy, values, packed):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(logp.shape, generator=g)
    target = torch.randn(values.shape, generator=g)
    mask = packed.completion_mask.float()
    return (logp * w).sum() + 0.1 * entropy.sum() + (((values - target) * mask) ** 2).sum()


def run(actor, critic, packed, dims):
    """Logits `(T, V)`, log-probs, entropy, values `(B, C)`, and parameter gradients after one backward."""
    shard = ulysses.shard_sequence(packed, dims)
    with torch.no_grad():
        logits = ulysses.gather_sequence(actor(**shard.model_inputs()).logits, shard, dim=1)[0]
    logp, entropy = ulysses.packed_logprobs(actor, actor.get_output_embeddings(), packed, dims, chunk_size=7,
                                            with_entropy=True)
    values = ulysses.packed_values(critic, critic.score, packed, dims)
    loss_of(logp, entropy, values, packed).backward()
    params = list(actor.named_parameters()) + [("critic." + n, p) for n, p in critic.named_parameters()]
    ulysses.sum_gradients_over_sp([p for _, p in params], dims)
    grads = {n: p.grad.detach().clone() for n, p in params}
    outputs = {"logits": logits, "logp": logp.detach(), "entropy": entropy.detach(), "values": values.detach()}
    return outputs, grads, shard


def compare(family, heads, kv_heads, dims, checkpointing=False, hidden=64):
    actor, critic = build(family, heads, kv_heads, hidden=hidden)
    ref_actor, ref_critic = copy.deepcopy(actor), copy.deepcopy(critic)
    packed = batch()
    want, want_grads, _ = run(ref_actor, ref_critic, packed, ParallelDims())
    for model in (actor, critic):
        ulysses.apply_sequence_parallel(model, dims)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()
    if checkpointing:
        ref_actor.train()  # the same (dropout-free) mode as the checkpointed run
    got, got_grads, shard = run(actor, critic, packed, dims)
    L = shard.length  # noqa: N806
    return {
        "attention": actor.config._attn_implementation,
        "attention_calls": shard.attention_calls,
        "length": packed.length, "real_tokens": packed.num_tokens, "shard_length": L,
        # the label of the last token of shard 0 is the first token of shard 1 (same row there)
        "boundary_label": int(packed.labels[0, L - 1]), "next_shard_first": int(packed.input_ids[0, L]),
        "boundary_same_row": bool(packed.segment_ids[L - 1] == packed.segment_ids[L]),
        "scored": int(packed.completion_mask.sum()),
        **{f"max_diff_{k}": (got[k] - want[k]).abs().max().item() for k in want},
        **{f"max_abs_{k}": want[k].abs().max().item() for k in want},
        "max_diff_grad": max((got_grads[n] - want_grads[n]).abs().max().item() for n in want_grads),
        "max_abs_grad": max(g.abs().max().item() for g in want_grads.values()),
        "params": len(want_grads),
        "params_with_gradient": sum(int(g.abs().max() > 0) for g in want_grads.values()),
    }


def refused(heads, kv_heads, dims):
    actor, _ = build("llama", heads, kv_heads, hidden=16 * heads)
    try:
        ulysses.apply_sequence_parallel(actor, dims)
    except ValueError as err:
        return str(err)
    return None


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dims = ParallelDims(sp=2, world_size=dist.get_world_size(), rank=rank)
    result = {
        "world": dist.get_world_size(), "sp_rank": dims.sp_rank, "group_rank": dist.get_rank(dims.sp_group),
        "cases": {
            "llama_gqa": compare("llama", 4, 2, dims),
            "qwen2_gqa": compare("qwen2", 4, 2, dims),
            "qwen2_kv1": compare("qwen2", 4, 1, dims),  # sp=2 > 1 KV head: replicated
            "llama_kv1_checkpointed": compare("llama", 4, 1, dims, checkpointing=True),
            "llama_h6_kv3": compare("llama", 6, 3, dims, hidden=96),  # KV heads replicated x2, 3 per rank
        },
        "refused": {"heads3": refused(3, 1, dims)},
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f, indent=1)
    leave_together()


if __name__ == "__main__":
    main(sys.argv[1])
