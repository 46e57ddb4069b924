"""Tests for :mod:`hf_verl.parallel.weight_export`: names, values, bucket sizes, LoRA merge, zero copy."""

import copy

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from hf_verl.parallel.weight_export import bucket_plan, iter_weight_buckets, unwrap_model


def _tiny_llama(tie: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        tie_word_embeddings=tie,
    )
    return LlamaForCausalLM(config).eval()


def _flatten(buckets):
    return [pair for bucket in buckets for pair in bucket]


def _assert_matches(pairs, reference):
    names = [name for name, _ in pairs]
    assert names == list(reference), set(names) ^ set(reference)
    for name, tensor in pairs:
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("tie", [False, True])
def test_plain_model_names_values_and_zero_copy(tie):
    model = _tiny_llama(tie)
    reference = model.state_dict()
    pairs = _flatten(iter_weight_buckets(model))
    _assert_matches(pairs, reference)
    params = {p.data_ptr() for p in model.parameters()}
    for name, tensor in pairs:
        assert not tensor.requires_grad
        assert tensor.data_ptr() == reference[name].data_ptr()
        assert tensor.data_ptr() in params  # a view of the parameter, not a copy


@pytest.mark.parametrize("tie", [False, True])
def test_bucket_sizes_respected(tie):
    model = _tiny_llama(tie)
    sizes = {name: t.numel() * t.element_size() for name, t in model.state_dict().items()}
    limit = 10_000  # embed_tokens / lm_head (64*32*4 = 8192 B) nearly fill a bucket; MLP weights don't
    buckets = list(iter_weight_buckets(model, bucket_bytes=limit))
    assert len(buckets) > 1
    for bucket in buckets:
        total = sum(sizes[name] for name, _ in bucket)
        assert total <= limit or len(bucket) == 1
    assert bucket_plan(model, limit) == [sum(sizes[n] for n, _ in b) for b in buckets]

    tiny = 100  # smaller than every weight: one tensor per bucket
    assert all(len(b) == 1 for b in iter_weight_buckets(model, bucket_bytes=tiny))
    assert len(bucket_plan(model, tiny)) == len(sizes)
    assert len(list(iter_weight_buckets(model, bucket_bytes=2**40))) == 1


def test_dtype_and_cpu_conversion():
    model = _tiny_llama(False)
    reference = model.state_dict()
    pairs = _flatten(iter_weight_buckets(model, dtype=torch.bfloat16, to_cpu=True))
    for name, tensor in pairs:
        assert tensor.dtype == torch.bfloat16 and tensor.device.type == "cpu"
        torch.testing.assert_close(tensor, reference[name].to(torch.bfloat16))
    full = sum(t.numel() * 4 for t in reference.values())
    assert sum(bucket_plan(model, 2**40, dtype=torch.bfloat16)) == full // 2


class _Wrapper(nn.Module):
    """Stand-in for DDP / accelerate: the real model under ``.module``."""

    def __init__(self, module):
        super().__init__()
        self.module = module


def test_wrapped_model_is_unwrapped():
    model = _tiny_llama(True)
    wrapped = _Wrapper(_Wrapper(model))
    assert unwrap_model(wrapped) is model
    _assert_matches(_flatten(iter_weight_buckets(wrapped, bucket_bytes=4096)), model.state_dict())


def test_real_ddp_is_unwrapped(tmp_path):
    dist = torch.distributed
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("gloo not available")
    model = _tiny_llama(False)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(model)
        _assert_matches(_flatten(iter_weight_buckets(ddp)), model.state_dict())
    finally:
        dist.destroy_process_group()


def test_peft_lora_merged_without_touching_model():
    peft = pytest.importorskip("peft")
    model = _tiny_llama(True)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    peft_model = peft.get_peft_model(model, config)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_()
    before = {k: v.clone() for k, v in peft_model.state_dict().items()}
    merged_reference = copy.deepcopy(peft_model).merge_and_unload().state_dict()

    pairs = _flatten(iter_weight_buckets(peft_model, bucket_bytes=8192))
    _assert_matches(pairs, merged_reference)
    names = [n for n, _ in pairs]
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert not any("lora_" in n or "base_layer" in n or n.startswith("base_model") for n in names)
    # the merge really changed q_proj (non-zero lora_B), and the peft model was not modified
    base_q = before["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"]
    assert not torch.equal(dict(pairs)["model.layers.0.self_attn.q_proj.weight"], base_q)
    after = peft_model.state_dict()
    assert list(after) == list(before)
    for key, value in before.items():
        assert torch.equal(after[key], value), key
    assert not any(getattr(m, "merged", False) for m in peft_model.modules())
    # the unmerged base tensors (k_proj, mlp, norms) are still zero-copy views
    k = dict(pairs)["model.layers.0.self_attn.k_proj.weight"]
    assert k.data_ptr() == model.model.layers[0].self_attn.k_proj.weight.data_ptr()
    assert bucket_plan(peft_model, 8192) == [
        sum(t.numel() * t.element_size() for _, t in b) for b in iter_weight_buckets(peft_model, bucket_bytes=8192)
    ]


def test_peft_lora_wrapped_in_ddp_like_module():
    peft = pytest.importorskip("peft")
    model = _tiny_llama(False)
    peft_model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.fill_(0.1)
    reference = copy.deepcopy(peft_model).merge_and_unload().state_dict()
    _assert_matches(_flatten(iter_weight_buckets(_Wrapper(peft_model))), reference)


def test_debug_log(caplog):
    model = _tiny_llama(False)
    with caplog.at_level("DEBUG", logger="hf_verl.parallel.weight_export"):
        n = len(list(iter_weight_buckets(model, bucket_bytes=10_000)))
    assert f"{n} buckets" in caplog.text


def test_rejects_non_positive_bucket():
    with pytest.raises(ValueError):
        next(iter_weight_buckets(_tiny_llama(False), bucket_bytes=0))


def test_fsdp2_dtensors_gathered_one_process(tmp_path):
    dist = torch.distributed
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("gloo not available")
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    model = _tiny_llama(True)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        assert all(isinstance(t, DTensor) for t in model.state_dict().values())
        pairs = _flatten(iter_weight_buckets(model, bucket_bytes=4096))
        assert not any(isinstance(t, DTensor) for _, t in pairs)
        _assert_matches(pairs, reference)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tie", [False, True])
def test_write_model_dir_reloads_as_the_same_model(tmp_path, tie):
    # the folder a colocated vLLM engine starts from (hf_verl.rollout.vllm_engine.write_model_dir)
    from hf_verl.rollout.vllm_engine import write_model_dir
    from tests.conftest import build_char_tokenizer

    model = _tiny_llama(tie)
    assert model.config.architectures is None  # built in code: the folder must name the class itself
    write_model_dir(model, build_char_tokenizer(), str(tmp_path))
    back = LlamaForCausalLM.from_pretrained(str(tmp_path))
    assert back.config.architectures == ["LlamaForCausalLM"] and model.config.architectures is None
    _assert_matches(list(back.state_dict().items()), model.state_dict())
    assert (tmp_path / "tokenizer.json").exists() or (tmp_path / "tokenizer_config.json").exists()


def test_write_model_dir_merges_a_peft_actor_under_base_names(tmp_path):
    peft = pytest.importorskip("peft")
    from hf_verl.rollout.vllm_engine import write_model_dir
    from tests.conftest import build_char_tokenizer

    peft_model = peft.get_peft_model(_tiny_llama(False), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_()
    reference = copy.deepcopy(peft_model).merge_and_unload().state_dict()
    write_model_dir(peft_model, build_char_tokenizer(), str(tmp_path))
    _assert_matches(list(LlamaForCausalLM.from_pretrained(str(tmp_path)).state_dict().items()), reference)
