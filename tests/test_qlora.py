"""QLoRA on the CPU: a LoRA actor over a bitsandbytes-quantized base trains with GRPO and with DPO on this machine.

Only the adapters train; the base stays quantized and unchanged. With asynchronous rollout and
`weight_sync="adapter"`, the actor copy the rollouts are generated on keeps the quantized base too, and every sync
copies the adapters' bytes only (nothing is merged into the packed k-bit weights); `hf-verl serve` gets the base once,
dequantized, then the adapters only, and generates the 4-bit actor's completions. Needs bitsandbytes >= 0.50 (its CPU
backend; the `qlora` extra): skipped without it.
"""

import logging

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import BitsAndBytesConfig, TrainerCallback

from hf_verl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer
from tests.conftest import build_char_tokenizer
from tests.test_quantization_config import _tiny

bnb = pytest.importorskip("bitsandbytes", reason="QLoRA needs bitsandbytes (pip install hf_verl[qlora])")
pytestmark = [pytest.mark.slow, pytest.mark.optional_backend,
              pytest.mark.skipif("cpu" not in getattr(bnb, "supported_torch_devices", ()),
                                 reason="this bitsandbytes has no CPU backend (0.50 has)")]

NF4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
INT8 = BitsAndBytesConfig(load_in_8bit=True)
LORA = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM")


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("qlora") / "tiny"
    _tiny(build_char_tokenizer()).save_pretrained(path)
    return str(path)


def _kbit_layers(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))}


def _snapshot(model):
    return {n: p.detach().clone() for n, p in model.state_dict().items()}


def _changed(before, model):
    return {n for n, p in model.state_dict().items() if not torch.equal(before[n], p)}


class _KeepCopy(TrainerCallback):
    """Keeps the actor copy asynchronous rollout generates on (the trainer frees it when training ends)."""

    def __init__(self, trainer):
        self.trainer, self.engine = trainer, None

    def on_step_end(self, args, state, control, **kwargs):
        self.engine = self.trainer._async_engine or self.engine


def _count_a(completions, **kwargs):
    return [float(c.count("a")) for c in completions]


def test_qlora_grpo_on_the_cpu_trains_the_adapters_and_syncs_only_them(tmp_path, tiny_path, caplog):
    from hf_verl.pipeline.sync import sync_weights

    tok = build_char_tokenizer()
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=3, logging_steps=1,
                      per_device_train_batch_size=4, num_generations=4, max_completion_length=6, learning_rate=5e-2,
                      gradient_checkpointing=False, save_strategy="no", use_async_rollout=True, weight_sync="adapter",
                      per_row_sampling_seed=True, seed=0)
    trainer = GRPOTrainer(model=tiny_path, reward_funcs=_count_a, args=args, processing_class=tok,
                          quantization_config=NF4, peft_config=LORA,
                          train_dataset=Dataset.from_dict({"prompt": ["abc", "xyz"] * 4}))
    actor = trainer.model
    assert actor.is_loaded_in_4bit and len(_kbit_layers(actor)) == 14  # 7 linear layers in each of 2 blocks
    before = _snapshot(actor)
    keep = _KeepCopy(trainer)
    trainer.add_callback(keep)
    with caplog.at_level(logging.DEBUG, logger="hf_verl.pipeline.sync"):
        trainer.train()
        sync_weights(trainer.actor, keep.engine)  # the copy to the last step's adapters
    changed = _changed(before, actor)
    assert changed and all("lora_" in n for n in changed)  # the adapters trained, the packed base did not change
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in trainer.state.log_history if "loss" in h)
    assert all(m.weight.dtype == torch.uint8 for m in _kbit_layers(actor).values())  # still 4-bit
    adapter_bytes = sum(p.numel() * p.element_size() for n, p in actor.named_parameters() if "lora_" in n)
    syncs = [r.getMessage() for r in caplog.records if r.getMessage().startswith("adapter weight sync")]
    assert len(syncs) >= 2 and set(syncs) == {f"adapter weight sync: {adapter_bytes} adapter bytes, 0 base bytes"}
    copy = keep.engine.model  # the copy: the same 4-bit base, unmerged, and the actor's adapters
    assert len(_kbit_layers(copy)) == 14
    for name, p in actor.state_dict().items():
        assert torch.equal(copy.state_dict()[name], p), name


@pytest.mark.parametrize("quantization", [NF4, INT8], ids=["4bit", "8bit"])
def test_qlora_dpo_on_the_cpu_lowers_the_loss_with_the_base_unchanged(tmp_path, tiny_path, quantization):
    tok = build_char_tokenizer()
    args = DPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=4, logging_steps=1,
                     per_device_train_batch_size=2, learning_rate=5e-2, gradient_checkpointing=False,
                     save_strategy="no", seed=0)
    pairs = Dataset.from_dict({"prompt": ["ab=", "cd="], "chosen": ["ba", "dc"], "rejected": ["ab", "cd"]})
    trainer = DPOTrainer(model=tiny_path, args=args, train_dataset=pairs, processing_class=tok,
                         quantization_config=quantization, peft_config=LORA)
    model = trainer.model
    assert len(_kbit_layers(model)) == 14
    before = _snapshot(model)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    changed = _changed(before, model)
    assert changed and all("lora_" in n for n in changed)


def test_qlora_grpo_against_hf_verl_serve_sends_the_base_once_dequantized(tmp_path, tiny_path, caplog, monkeypatch):
    """The server holds a full-precision model: the first sync sends the base dequantized (the values the 4-bit
    actor computes with), every later one the adapters only; the server ends generating as the actor."""
    from hf_verl.rollout.base import SamplingParams
    from hf_verl.rollout.hf_engine import TransformersEngine
    from hf_verl.serve.server import RolloutServer

    tok = build_char_tokenizer()
    torch.manual_seed(1)
    server = RolloutServer(TransformersEngine(_tiny(tok), tok), tok, "tiny", port=0, token="t0k").start()
    monkeypatch.setenv("HF_VERL_SERVE_TOKEN", "t0k")
    try:
        args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=2, logging_steps=1,
                          per_device_train_batch_size=4, num_generations=4, max_completion_length=6,
                          learning_rate=5e-2, gradient_checkpointing=False, save_strategy="no",
                          weight_sync="adapter", placement={"generator": server.address}, seed=0)
        trainer = GRPOTrainer(model=tiny_path, reward_funcs=_count_a, args=args, processing_class=tok,
                              quantization_config=NF4, peft_config=LORA,
                              train_dataset=Dataset.from_dict({"prompt": ["abc", "xyz"] * 4}))
        actor = trainer.model
        with caplog.at_level(logging.DEBUG, logger="hf_verl.pipeline.sync"):
            trainer.train()
        adapter_bytes = sum(p.numel() * p.element_size() for n, p in actor.named_parameters() if "lora_" in n)
        full_bytes = sum(p.numel() * p.element_size() for p in server.engine.model.get_base_model().parameters()
                         if p.dtype == torch.float32) - adapter_bytes
        syncs = [r.getMessage() for r in caplog.records if r.getMessage().startswith("adapter weight sync")]
        assert syncs[0] == f"adapter weight sync: {adapter_bytes} adapter bytes, {full_bytes} base bytes"
        assert set(syncs[1:]) == {f"adapter weight sync: {adapter_bytes} adapter bytes, 0 base bytes"}, syncs
        assert all(m.weight.dtype == torch.uint8 for m in _kbit_layers(actor).values())  # the trainer's stays 4-bit
        greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
        prompts = [tok("abc").input_ids, tok("hello").input_ids]
        local = TransformersEngine(actor, tok).generate(prompts, greedy)
        served = trainer.engine.generate(prompts, greedy)
        assert served.completion_ids == local.completion_ids
        for a, b in zip(served.logprobs, local.logprobs):
            assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-4)
    finally:
        server.shutdown()
