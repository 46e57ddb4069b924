"""Three training steps of GRPO, PPO (with a critic and a reference) or DPO on one global batch.

ALGO "facade" runs the role facade's loop (critic, reference) instead of a trainer. `PARITY_PLACEMENT` (JSON) puts
the trainer config's `placement` on the roles (a critic or reference on its own backend).
Run alone (`python -m tests.distributed.parity ALGO OUT`) it is the single-process baseline; run
under `accelerate launch --config_file configs/accelerate/<backend>_cpu.yaml` it trains the same
global batch split over 2 processes on that backend. The main rank writes `OUT/result.json` (the
logged losses, the backend and layout the trainer actually got, the type of its parameters, and
how far the sharded weight export is from the unsharded initial weights) and the final weights
(`save_model` into `OUT/final`, the critic under `final/critic`).

`PARITY_LORA=1` gives GRPO and DPO a `peft_config` (:func:`lora_config`): the adapters train, the reference is the
model with the adapters off, and `save_model` writes the PEFT adapter directory.

GRPO and PPO sample with `per_row_sampling_seed`, so the rollouts are the same however the rows
are split; every optimizer step uses one micro-batch (the whole round), so that the token-mean
normalisers see the same tokens.
"""

import json
import os
import sys

import torch
from datasets import Dataset

from tests.conftest import build_char_tokenizer

GLOBAL_ROWS = 8
SP = int(os.environ.get("PARITY_SP", "1"))  # sequence-parallel degree: the world's processes are dp x SP
# backend="megatron" at "tp,pp" (the world's processes are dp x tp x pp); empty: the launch's backend
MEGATRON = tuple(int(x) for x in os.environ["PARITY_MEGATRON"].split(",")) if os.environ.get("PARITY_MEGATRON") else None
MODEL_PARALLEL = SP * (MEGATRON[0] * MEGATRON[1] if MEGATRON else 1)


def tiny_qwen2(tok, cls="Qwen2ForCausalLM", seed=0, **kw):
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                                   eos_token_id=tok.eos_token_id, tie_word_embeddings=False, **kw)
    return getattr(transformers, cls)(cfg)


def lora_config(algo):
    """The LoraConfig of a `PARITY_LORA=1` run, else None: rslora, no dropout; GRPO adapts some of the fused
    modules' parts (q and v of q/k/v, up of gate/up), DPO every linear of the decoder."""
    if os.environ.get("PARITY_LORA") != "1":
        return None
    from peft import LoraConfig

    targets = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"] if algo == "grpo" else "all-linear"
    dropout = float(os.environ.get("PARITY_LORA_DROPOUT", "0"))  # parity needs 0 (masks differ per layout)
    return LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=targets, use_rslora=True)


def count_a(completions, **kwargs):
    return [float(c.count("a")) + 0.1 * len(c) for c in completions]


def common(out, world):
    sp = {"sequence_parallel_size": SP} if SP > 1 else {}
    if MEGATRON and not os.environ.get("PARITY_MEGATRON_FROM_LAUNCH"):  # else an accelerate MEGATRON_LM config asks
        sp.update(backend="megatron", tensor_model_parallel_size=MEGATRON[0], pipeline_model_parallel_size=MEGATRON[1])
    if os.environ.get("PARITY_PLACEMENT"):  # the roles' placement in the trainer config (JSON)
        sp["placement"] = json.loads(os.environ["PARITY_PLACEMENT"])
    return dict(output_dir=out, use_cpu=os.environ.get("PARITY_USE_CPU", "1") == "1", report_to=[], max_steps=3,
                logging_steps=1, per_device_train_batch_size=GLOBAL_ROWS // (world // MODEL_PARALLEL),
                gradient_accumulation_steps=1,
                **sp,
                learning_rate=float(os.environ.get("PARITY_LR", "1e-3")), lr_scheduler_type="constant",
                save_strategy="no", disable_tqdm=True, seed=11, bf16=False,
                gradient_checkpointing=os.environ.get("PARITY_GRADIENT_CHECKPOINTING") == "1")


def build(algo, out, world, tok):
    prompts = ["abc", "xyz", "hello", "ab", "b", "cc", "dd", "e", "aa", "ba", "ca", "da"]
    if algo == "grpo":
        from hf_verl import GRPOConfig, GRPOTrainer

        args = GRPOConfig(num_generations=4, max_completion_length=6, beta=0.05, temperature=1.0,
                          per_row_sampling_seed=True, **common(out, world))
        # a reward model object beside the rule: sharded with the policy under FSDP2 / ZeRO-3
        reward_model = tiny_qwen2(tok, "Qwen2ForSequenceClassification", seed=2, num_labels=1)
        return GRPOTrainer(model=tiny_qwen2(tok), reward_funcs=[count_a, reward_model], args=args,
                           reward_processing_classes=[None, tok],
                           train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tok,
                           peft_config=lora_config(algo))
    if algo == "ppo":
        from hf_verl import PPOConfig, PPOTrainer

        args = PPOConfig(num_mini_batches=1, num_ppo_epochs=1, response_length=6, stop_token="eos", kl_coef=0.05,
                         per_row_sampling_seed=True, critic_learning_rate=2e-3, **common(out, world))
        critic = tiny_qwen2(tok, "Qwen2ForSequenceClassification", seed=1, num_labels=1)
        return PPOTrainer(args=args, processing_class=tok, model=tiny_qwen2(tok), reward_model=count_a,
                          train_dataset=Dataset.from_dict({"prompt": prompts * 2}), value_model=critic)
    from hf_verl import DPOConfig, DPOTrainer

    pairs = {"prompt": [p + "=" for p in prompts] * 3,
             "chosen": [p[::-1] for p in prompts] * 3, "rejected": [p + p for p in prompts] * 3}
    args = DPOConfig(max_length=32, beta=0.1, **common(out, world))
    return DPOTrainer(model=tiny_qwen2(tok), args=args, train_dataset=Dataset.from_dict(pairs), processing_class=tok,
                      peft_config=lora_config(algo))


def resume_run(out, world, tok):
    """GRPO for 4 steps with checkpoints every 2, then a fresh trainer resumed from checkpoint-2: its
    steps 3-4 must log the losses of the uninterrupted run (weights, optimizer shards, schedule, RNG)."""
    from hf_verl import GRPOConfig, GRPOTrainer

    prompts = ["abc", "xyz", "hello", "ab", "b", "cc", "dd", "e", "aa", "ba", "ca", "da"]

    def trainer():
        kw = dict(common(out, world), max_steps=4, save_strategy="steps", save_steps=2)
        args = GRPOConfig(num_generations=4, max_completion_length=6, per_row_sampling_seed=True, **kw)
        return GRPOTrainer(model=tiny_qwen2(tok), reward_funcs=count_a, args=args,
                           train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tok,
                           peft_config=lora_config("grpo"))

    def losses(t):
        return {h["step"]: h["loss"] for h in t.state.log_history if "loss" in h}

    full = trainer()
    full.train()
    resumed = trainer()
    resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
    return full, losses(full), losses(resumed)


def facade_run(out, world, tok, rank):
    """The facade's loop with a critic (GAE) and a KL reference, on this rank's slice of each global batch."""
    from hf_verl import Trainer
    from hf_verl.parallel import comm

    prompts = ["abc", "xyz", "hello", "ab", "b", "cc"]
    actor, reference = tiny_qwen2(tok), tiny_qwen2(tok)
    if lora_config("facade") is not None:  # a PeftModel actor: its reference is the actor with the adapters off
        from peft import get_peft_model

        actor, reference = get_peft_model(actor, lora_config("facade")), None
    facade = Trainer(actor_model=actor, reference_model=reference,
                     critic_model=tiny_qwen2(tok, "Qwen2ForSequenceClassification", seed=1, num_labels=1),
                     reward_model=count_a, tokenizer=tok,
                     config=dict(num_generations=4, max_completion_length=6, beta=0.05, learning_rate=1e-3,
                                 critic_learning_rate=2e-3, seed=11, per_row_sampling_seed=True,
                                 sequence_parallel_size=SP,
                                 **(dict(backend="megatron", tensor_model_parallel_size=MEGATRON[0],
                                         pipeline_model_parallel_size=MEGATRON[1]) if MEGATRON else {})))
    # the model-parallel ranks of one data-parallel rank (sp, tp, pp) take the same prompts
    dp_size, dp_rank = facade.dims.dp_size, facade.dims.dp_rank
    per_rank = 2 // dp_size
    losses, values = [], []
    for step in range(3):
        batch = prompts[2 * step : 2 * step + 2][dp_rank * per_rank : (dp_rank + 1) * per_rank]
        loss = facade.compute_loss(facade.rollout(batch))
        losses.append(comm.reduce(facade.dims, loss.detach().reshape(1), "mean").item())
        values.append(comm.reduce(facade.dims, torch.tensor([facade._loss_metrics["loss/value"]]), "mean").item())
        facade.step(loss)
    facade.save_pretrained(os.path.join(out, "final"))
    return facade, losses, {"loss/value_avg": values, "reward": [], "rewards/chosen": []}


def export_error(trainer, initial):
    """Largest |exported - initial| over the actor's weights (before any step), on the main rank."""
    trainer.create_optimizer()  # DeepSpeed partitions the model when it gets its optimizer
    worst, names = 0.0, []
    for bucket in trainer.actor.export_weights(64 * 1024):
        for name, tensor in bucket:
            names.append(name)
            if name in initial:
                worst = max(worst, (tensor.float().cpu() - initial[name].float()).abs().max().item())
    return worst, sorted(names) == sorted(initial)


def lora_parts(trainer, initial, out):
    """A LoRA actor's export parts after training (a collective): the base weights alone must be the initial ones
    (frozen); the adapters alone (the PeftModel's own keys) go to OUT/adapter_export.safetensors."""
    from safetensors.torch import save_file

    base = dict(pair for part in trainer.actor.export_weights(64 * 1024, lora="base") for pair in part)
    adapter = dict(pair for part in trainer.actor.export_weights(64 * 1024, lora="adapter") for pair in part)
    if trainer.dims.is_main:
        save_file({k: v.detach().cpu().contiguous() for k, v in adapter.items()},
                  os.path.join(out, "adapter_export.safetensors"))
    return {"base_export_names_match": sorted(base) == sorted(initial),
            "base_export_max_error": max((base[k].float().cpu() - initial[k].float()).abs().max().item()
                                         for k in initial if k in base)}


def main(algo: str, out: str) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tok = build_char_tokenizer()
    if algo == "resume":
        trainer, full, resumed = resume_run(out, world, tok)
        if trainer.dims.is_main:
            with open(os.path.join(out, "result.json"), "w") as f:
                json.dump({"full": full, "resumed": resumed, "backend": trainer.backend.label}, f)
        return
    if algo == "facade":
        facade, losses, extra = facade_run(out, world, tok, int(os.environ.get("RANK", "0")))
        engine = facade.actor_engine
        if facade.dims.is_main:
            param = next(engine.model.parameters())
            with open(os.path.join(out, "result.json"), "w") as f:
                json.dump({"losses": losses, "extra": extra, "backend": engine.backend.label,
                           "world": facade.dims.world_size, "dp_size": facade.dims.dp_size, "sp": facade.dims.sp,
                           "attention": engine.config._attn_implementation,
                           "param_type": type(param).__name__, "zero3_partitioned": hasattr(param, "ds_id"),
                           "export_max_error": 0.0, "export_names_match": True,
                           "roles": {} if facade.roles.engine("reference") is None else {"reference": "engine"},
                           "trainable": sorted(n for n, p in engine.model.named_parameters() if p.requires_grad)},
                          f)
        return
    trainer = build(algo, out, world, tok)
    initial = {k: v.detach().clone() for k, v in tiny_qwen2(tok).state_dict().items()}
    err, same_names = export_error(trainer, initial)
    param = next(trainer.actor.model.parameters())
    trainer.train()
    trainer.save_model(os.path.join(out, "final"))
    parts = lora_parts(trainer, initial, out) if lora_config(algo) is not None else {}
    if trainer.dims.is_main:
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        extra = {k: [h[k] for h in trainer.state.log_history if k in h]
                 for k in ("loss/value_avg", "reward", "rewards/chosen")}
        roles = {name: getattr(trainer, name).backend.label for name in ("reference", "critic")
                 if getattr(getattr(trainer, name, None), "backend", None) is not None}
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"losses": losses, "extra": extra, "backend": trainer.backend.label, "roles": roles,
                       "world": trainer.dims.world_size, "dp_size": trainer.dims.dp_size, "sp": trainer.dims.sp,
                       "attention": trainer.actor.config._attn_implementation,
                       "param_type": type(param).__name__, "zero3_partitioned": hasattr(param, "ds_id"),
                       "export_max_error": err, "export_names_match": same_names,
                       "trainable": sorted(n for n, p in trainer.actor.model.named_parameters() if p.requires_grad),
                       **parts}, f)


if __name__ == "__main__":
    from hf_verl.parallel.comm import leave_together

    main(sys.argv[1], sys.argv[2])
    leave_together()
