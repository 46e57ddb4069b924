"""`quantization_config` on GRPOTrainer and DPOTrainer (QLoRA, TRL 1.16's argument): where it goes, and the errors
at construction, before any weight loads, where the run cannot use it (no bitsandbytes, a sharded layout, vLLM or a
server generator, asynchronous rollout without adapter-only sync). QLoRA training itself: tests/test_qlora.py."""

import logging
import sys

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import BitsAndBytesConfig, Qwen2Config, Qwen2ForCausalLM

from hf_verl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer
from hf_verl.trainers.quantization import merge_quantization_config
from tests.conftest import build_char_tokenizer

NEVER_LOADED = "org/never-loaded"  # no such model anywhere: a check that fires before loading never looks it up
QLORA = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
LORA = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def _grpo_args(tmp_path, use_cpu=True, **kw):
    return GRPOConfig(output_dir=str(tmp_path), use_cpu=use_cpu, report_to=[], max_steps=1, num_generations=2,
                      per_device_train_batch_size=2, max_completion_length=4, gradient_checkpointing=False,
                      save_strategy="no", **kw)


def _dpo_args(tmp_path, **kw):
    return DPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=1, per_device_train_batch_size=2,
                     gradient_checkpointing=False, save_strategy="no", **kw)


def _reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


PROMPTS = Dataset.from_dict({"prompt": ["abc", "xyz"]})
PAIRS = Dataset.from_dict({"prompt": ["ab="], "chosen": ["ba"], "rejected": ["ab"]})


def _grpo(tmp_path, model=NEVER_LOADED, args=None, **kw):
    return GRPOTrainer(model=model, reward_funcs=_reward, args=args or _grpo_args(tmp_path), train_dataset=PROMPTS,
                       processing_class=build_char_tokenizer(), **kw)


def _dpo(tmp_path, model=NEVER_LOADED, args=None, **kw):
    return DPOTrainer(model=model, args=args or _dpo_args(tmp_path), train_dataset=PAIRS,
                      processing_class=build_char_tokenizer(), **kw)


def _tiny(tok):
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tok),
                                        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id))


# ---------------------------------------------------------------------- where the argument goes (TRL's rules)
def test_quantization_config_joins_the_loading_kwargs_once():
    merged = merge_quantization_config("org/m", {"dtype": "bfloat16"}, QLORA, refuse_model_object=False)
    assert merged == {"dtype": "bfloat16", "quantization_config": QLORA}
    assert merge_quantization_config("org/m", None, None, refuse_model_object=True) == {}
    kwargs = {"quantization_config": QLORA}
    assert merge_quantization_config("org/m", kwargs, None, refuse_model_object=True) == kwargs
    with pytest.raises(ValueError, match="both as a trainer argument and in args.model_init_kwargs"):
        merge_quantization_config("org/m", kwargs, QLORA, refuse_model_object=False)


@pytest.mark.parametrize("make", [_grpo, _dpo], ids=["grpo", "dpo"])
def test_set_twice_is_refused_by_both_trainers(tmp_path, make):
    args = (_grpo_args if make is _grpo else _dpo_args)(tmp_path, model_init_kwargs={"quantization_config": QLORA})
    with pytest.raises(ValueError, match="both as a trainer argument and in args.model_init_kwargs"):
        make(tmp_path, args=args, quantization_config=QLORA, peft_config=LORA)


def test_a_model_object_cannot_be_quantized_grpo_warns_dpo_refuses(tmp_path, caplog):
    tok = build_char_tokenizer()
    with caplog.at_level(logging.WARNING, logger="hf_verl.trainers.quantization"):
        trainer = _grpo(tmp_path, model=_tiny(tok), quantization_config=QLORA)
    assert "quantization_config is ignored" in caplog.text
    assert not getattr(trainer.actor.model, "is_loaded_in_4bit", False)
    assert next(trainer.actor.model.parameters()).dtype == torch.float32
    with pytest.raises(ValueError, match="already instantiated.*pass the model id"):
        _dpo(tmp_path, model=_tiny(tok), quantization_config=QLORA)


# ---------------------------------------------------------------------- refused at construction, before loading
@pytest.mark.parametrize("make", [_grpo, _dpo], ids=["grpo", "dpo"])
def test_qlora_without_bitsandbytes_fails_at_construction_naming_what_to_do(tmp_path, make, monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` fails, as where it is missing
    with pytest.raises(ImportError, match="bitsandbytes does not import") as err:
        make(tmp_path, quantization_config=QLORA, peft_config=LORA)
    message = str(err.value)
    assert "4-bit bitsandbytes base" in message and "pip install bitsandbytes" in message
    assert "keep peft_config and drop quantization_config" in message  # LoRA without quantization
    # given through model_init_kwargs (TRL's other place), the same check
    args = (_grpo_args if make is _grpo else _dpo_args)(tmp_path, model_init_kwargs={"quantization_config": QLORA})
    with pytest.raises(ImportError, match="bitsandbytes does not import"):
        make(tmp_path, args=args, peft_config=LORA)


def test_a_quantized_base_needs_adapters_a_whole_model_layout_and_no_vllm(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="cannot be trained itself.*pass peft_config"):
        _grpo(tmp_path, quantization_config=QLORA)
    with pytest.raises(ValueError, match="use_vllm=True with a quantized base.*use_vllm=False"):
        _grpo(tmp_path, args=_grpo_args(tmp_path, use_vllm=True), quantization_config=QLORA, peft_config=LORA)
    with pytest.raises(ValueError, match="placement\\['generator'\\] with a quantized base"):
        _grpo(tmp_path, args=_grpo_args(tmp_path, placement={"generator": "http://127.0.0.1:1"}),
              quantization_config=QLORA, peft_config=LORA)
    with pytest.raises(ValueError, match="use_async_rollout=True with a quantized base needs weight_sync='adapter'"):
        _grpo(tmp_path, args=_grpo_args(tmp_path, use_async_rollout=True), quantization_config=QLORA,
              peft_config=LORA)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    with pytest.raises(ValueError, match="with fsdp2 .* not supported.*one process or with DDP"):
        _dpo(tmp_path, quantization_config=QLORA, peft_config=LORA)


def test_the_config_reaches_from_pretrained_when_the_model_is_given_by_path(tmp_path, monkeypatch):
    """Past hf_verl's own check (switched off here: it refuses this CPU), the BitsAndBytesConfig is what
    transformers' `from_pretrained` quantizes with: without bitsandbytes its own bitsandbytes error comes back."""
    pytest.importorskip("peft")
    if _bitsandbytes_imports():
        pytest.skip("bitsandbytes is installed: from_pretrained would quantize for real (see the GPU check)")
    tok = build_char_tokenizer()
    path = tmp_path / "tiny"
    _tiny(tok).save_pretrained(path)
    import hf_verl.trainers.dpo_trainer as dpo_module
    import hf_verl.trainers.grpo_trainer as grpo_module

    for module in (grpo_module, dpo_module):
        monkeypatch.setattr(module, "check_quantized_run", lambda *a, **k: None)
    for make in (_grpo, _dpo):
        with pytest.raises(ImportError, match="bitsandbytes` 4-bit quantization requires bitsandbytes"):
            make(tmp_path, model=str(path), quantization_config=QLORA, peft_config=LORA)
    # without quantization_config the same path loads in full precision
    trainer = _dpo(tmp_path, model=str(path), peft_config=LORA)
    assert not getattr(trainer.model, "is_loaded_in_4bit", False)


def _bitsandbytes_imports() -> bool:
    try:
        import bitsandbytes  # noqa: F401
    except Exception:
        return False
    return True


@pytest.mark.slow
@pytest.mark.optional_backend
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="the CUDA variant (tests/test_qlora.py trains QLoRA on the CPU)")
def test_qlora_trains_only_the_adapters_on_a_4bit_base(tmp_path):
    pytest.importorskip("bitsandbytes")
    tok = build_char_tokenizer()
    path = tmp_path / "tiny"
    _tiny(tok).save_pretrained(path)
    args = _grpo_args(tmp_path, use_cpu=False, max_steps=2, learning_rate=1e-2, bf16=True)
    trainer = _grpo(tmp_path, model=str(path), args=args, quantization_config=QLORA, peft_config=LORA)
    model = trainer.actor.model
    assert model.is_loaded_in_4bit
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train()
    changed = {n for n, p in model.named_parameters() if not torch.equal(before[n], p.detach())}
    assert changed and all("lora_" in n for n in changed)
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in trainer.state.log_history if "loss" in h)
