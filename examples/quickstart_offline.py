"""The quickstart's GRPO script, offline: the same calls as docs/quickstart.md section 2, on a model built in code.

No Hub, no GPU: the demo's 0.33M-parameter Llama and character tokenizer stand in for Qwen2.5-0.5B-Instruct, and
the demo's reverse-a-string task (a `prompt` and an `answer` column, an exact-match reward that reads `answer`)
for GSM8K. A short supervised warm-up first, so that some completions are right and GRPO has a signal; then
100 GRPO steps, `trainer.save_model`, and the saved model loaded back with `from_pretrained`.
Run (venv activated): `python examples/quickstart_offline.py`; it writes `quickstart-offline/` in the current
folder. Its test (`tests/test_demo.py::test_offline_quickstart_runs_as_documented`) took 63 s on a 2-core machine
shared with other work; it was not timed on a quiet one.
"""

from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_verl import GRPOConfig, GRPOTrainer
from hf_verl.demo.run import build_tiny_model, greedy_accuracy, supervised_warmup
from hf_verl.demo.task import build_char_tokenizer, make_split, reverse_reward

split = make_split(seed=0)
tokenizer = build_char_tokenizer()
model = build_tiny_model(tokenizer, seed=0)
supervised_warmup(model, tokenizer, split.train_prompts, split.train_answers, target_accuracy=0.35)
before = greedy_accuracy(model, tokenizer, split.heldout_prompts, split.heldout_answers)

dataset = Dataset.from_dict({"prompt": split.train_prompts, "answer": split.train_answers})
trainer = GRPOTrainer(
    model=model,
    processing_class=tokenizer,
    reward_funcs=reverse_reward,                # reads the dataset's `answer` column
    args=GRPOConfig(output_dir="quickstart-offline", num_generations=8, per_device_train_batch_size=128,
                    max_completion_length=6, learning_rate=5e-4, lr_scheduler_type="constant", max_steps=100,
                    logging_steps=10, save_strategy="no", report_to=[], use_cpu=True),
    train_dataset=dataset,
)
trainer.train()
trainer.save_model("quickstart-offline/final")  # weights, config and tokenizer

reloaded = AutoModelForCausalLM.from_pretrained("quickstart-offline/final")
reloaded_tok = AutoTokenizer.from_pretrained("quickstart-offline/final")
after = greedy_accuracy(reloaded, reloaded_tok, split.heldout_prompts, split.heldout_answers)
print(f"held-out greedy accuracy: {before:.1%} before GRPO, {after:.1%} after {trainer.state.global_step} steps "
      "(the reloaded model from quickstart-offline/final)")
