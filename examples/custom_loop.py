"""Train the demo model (reverse 5-letter strings) with a hand-written loop over `hf_verl.Trainer`.

GRPO (no critic), lr 5e-4, 16 prompts x 8 generations, 6 new tokens, temperature 1.0, 300 steps,
after the demo's supervised warm-up, with asynchronous rollout on: each `rollout()` hands out the
rollout generated in the background during the previous step (staleness 1, importance-sampling
corrected). Run: `python examples/custom_loop.py` (CPU, about 1 minute on 2 cores).
"""

import torch

from hf_verl import Trainer
from hf_verl.demo.run import build_tiny_model, greedy_accuracy, supervised_warmup
from hf_verl.demo.task import build_char_tokenizer, make_split, reverse_reward

torch.manual_seed(0)
split, tok = make_split(seed=0), build_char_tokenizer()
model = build_tiny_model(tok)
supervised_warmup(model, tok, split.train_prompts, split.train_answers, target_accuracy=0.35)
before = greedy_accuracy(model, tok, split.heldout_prompts, split.heldout_answers)

trainer = Trainer(actor_model=model, reward_model=reverse_reward, tokenizer=tok,
                  dataset=[{"prompt": p, "answer": a} for p, a in zip(split.train_prompts, split.train_answers)],
                  config=dict(learning_rate=5e-4, rollout_batch_size=16, num_generations=8, max_completion_length=6,
                              temperature=1.0, use_async_rollout=True))
for step in range(300):
    rollout = trainer.rollout()                 # draws 16 prompts from the dataset
    metrics = trainer.step(trainer.compute_loss(rollout))
    if step % 25 == 0:
        print(f"step {step:3d}  reward {metrics['reward/mean']:.3f}  staleness {metrics['rollout/staleness']}  "
              f"waited {metrics['time/rollout_wait_s']:.3f}s  trace {metrics['trace_id']}")
trainer.close()  # stops the background rollout worker

after = greedy_accuracy(model, tok, split.heldout_prompts, split.heldout_answers)
print(f"held-out greedy accuracy: before {before:.3f}, after {after:.3f}")
