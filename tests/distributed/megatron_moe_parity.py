"""Three training steps of GRPO, PPO, DPO or the facade's loop on a tiny Mixture-of-Experts actor (Qwen3-MoE, 4
experts, top-2), as tests/distributed/parity.py runs them for dense models.

Run alone (`python -m tests.distributed.megatron_moe_parity ALGO OUT`) it is the one-process baseline on the default
backend; under `torchrun --nproc_per_node 2` with `MOE_EP=2` it runs every role on `backend="megatron"` with
`expert_model_parallel_size=2`: two data-parallel ranks, each holding two of the four experts, tokens sent to their
experts by the all-to-all dispatcher. The same global batch of 8 rows is split over the ranks, 4 each.

DPO trains with a non-zero `router_aux_loss_coef`: the load-balancing loss is not linear in the rows, and, as on
the accelerate engines, the Megatron engine takes it over the global batch (expert counts and probability sums
all-reduced over the data-parallel ranks), so two ranks of 4 rows give the loss of one process on the 8. GRPO, PPO
and the facade (critic dense, beside the MoE actor) run with the coefficient at 0. The main rank writes `OUT/result.json`
(losses, layout, export check) and the final weights (`OUT/final`). With `MOE_FROM_LAUNCH=1` the config names no
backend: an `accelerate launch --config_file configs/accelerate/megatron_ep2_cpu.yaml` asks for it.
"""

import json
import os
import sys

import torch
from datasets import Dataset

from tests.conftest import build_char_tokenizer
from tests.distributed.parity import count_a, export_error, tiny_qwen2

GLOBAL_ROWS = 8
EP = int(os.environ.get("MOE_EP", "0"))  # 0: the one-process baseline on the default backend
DPO_AUX = 0.05
PROMPTS = ["abc", "xyz", "hello", "ab", "b", "cc", "dd", "e", "aa", "ba", "ca", "da"]


def tiny_moe(tok, seed=0, aux=0.0):
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                                      num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=len(tok),
                                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                      tie_word_embeddings=False, router_aux_loss_coef=aux)
    model = transformers.Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():  # routers wider than the default init: routing changes from token to token
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    return model


def common(out, world):
    from_launch = os.environ.get("MOE_FROM_LAUNCH") == "1"  # the accelerate MEGATRON_LM config asks instead
    megatron = dict(backend="megatron", expert_model_parallel_size=EP) if EP and not from_launch else {}
    return dict(output_dir=out, use_cpu=True, report_to=[], max_steps=3, logging_steps=1,
                per_device_train_batch_size=GLOBAL_ROWS // world, gradient_accumulation_steps=1, **megatron,
                learning_rate=1e-3,
                lr_scheduler_type="constant", save_strategy="no", disable_tqdm=True, seed=11,
                gradient_checkpointing=False, bf16=False)


def build(algo, out, world, tok):
    if algo == "grpo":
        from hf_verl import GRPOConfig, GRPOTrainer

        args = GRPOConfig(num_generations=4, max_completion_length=6, beta=0.05, temperature=1.0,
                          per_row_sampling_seed=True, **common(out, world))
        return GRPOTrainer(model=tiny_moe(tok), reward_funcs=count_a, args=args,
                           train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tok)
    if algo == "ppo":
        from hf_verl import PPOConfig, PPOTrainer

        args = PPOConfig(num_mini_batches=1, num_ppo_epochs=1, response_length=6, stop_token="eos", kl_coef=0.05,
                         per_row_sampling_seed=True, critic_learning_rate=2e-3, **common(out, world))
        critic = tiny_qwen2(tok, "Qwen2ForSequenceClassification", seed=1, num_labels=1)
        return PPOTrainer(args=args, processing_class=tok, model=tiny_moe(tok), reward_model=count_a,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS * 2}), value_model=critic)
    from hf_verl import DPOConfig, DPOTrainer

    pairs = {"prompt": [p + "=" for p in PROMPTS] * 3,
             "chosen": [p[::-1] for p in PROMPTS] * 3, "rejected": [p + p for p in PROMPTS] * 3}
    args = DPOConfig(max_length=32, beta=0.1, router_aux_loss_coef=DPO_AUX, **common(out, world))
    return DPOTrainer(model=tiny_moe(tok, aux=DPO_AUX), args=args, train_dataset=Dataset.from_dict(pairs),
                      processing_class=tok)


def facade_run(out, tok):
    """The facade's loop with a dense critic (GAE) and a KL reference, on this rank's half of each global batch."""
    from hf_verl import Trainer
    from hf_verl.parallel import comm

    prompts = PROMPTS[:6]
    facade = Trainer(actor_model=tiny_moe(tok), reference_model=tiny_moe(tok),
                     critic_model=tiny_qwen2(tok, "Qwen2ForSequenceClassification", seed=1, num_labels=1),
                     reward_model=count_a, tokenizer=tok,
                     config=dict(num_generations=4, max_completion_length=6, beta=0.05, learning_rate=1e-3,
                                 critic_learning_rate=2e-3, seed=11, per_row_sampling_seed=True,
                                 **(dict(backend="megatron", expert_model_parallel_size=EP) if EP else {})))
    dp_size, dp_rank = facade.dims.dp_size, facade.dims.dp_rank
    per_rank = 2 // dp_size
    losses = []
    for step in range(3):
        batch = prompts[2 * step : 2 * step + 2][dp_rank * per_rank : (dp_rank + 1) * per_rank]
        loss = facade.compute_loss(facade.rollout(batch))
        losses.append(comm.reduce(facade.dims, loss.detach().reshape(1), "mean").item())
        facade.step(loss)
    facade.save_pretrained(os.path.join(out, "final"))
    return facade, losses


def main(algo: str, out: str) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tok = build_char_tokenizer()
    if algo == "facade":
        facade, losses = facade_run(out, tok)
        dims, backend, err, same = facade.dims, facade.actor_engine.backend.label, 0.0, True
    else:
        trainer = build(algo, out, world, tok)
        initial = {k: v.detach().clone() for k, v in tiny_moe(tok).state_dict().items()}
        err, same = export_error(trainer, initial)
        trainer.train()
        trainer.save_model(os.path.join(out, "final"))
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        dims, backend = trainer.dims, trainer.backend.label
    if dims.is_main:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"losses": losses, "backend": backend, "world": dims.world_size, "dp_size": dims.dp_size,
                       "ep": dims.ep, "export_max_error": err, "export_names_match": same}, f)


if __name__ == "__main__":
    from hf_verl.parallel.comm import leave_together

    main(sys.argv[1], sys.argv[2])
    leave_together()
