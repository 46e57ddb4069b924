"""bf16 on fp32 parameters: the plain and DDP layouts run their forwards (training, reference, generation)
under autocast, so `bf16=True` is honoured rather than accepted and ignored; fp16 without loss scaling is
refused with a message."""

import math

import pytest
import torch
from datasets import Dataset

from hf_verl.parallel.precision import amp_dtype
from hf_verl.parallel.backend import BackendSpec
from hf_verl.parallel.dims import ParallelDims
from hf_verl.rollout.base import SamplingParams
from hf_verl.rollout.hf_engine import TransformersEngine
from tests.conftest import build_char_tokenizer
from tests.test_grpo_trainer import _args, _model
from tests.test_parallel_layout import _batch


class MatmulDtypes:
    """Records the output dtype of every `nn.Linear` call of a model."""

    def __init__(self, model):
        self.seen: list[torch.dtype] = []
        self.handles = [m.register_forward_hook(lambda _m, _a, out: self.seen.append(out.dtype))
                        for m in model.modules() if isinstance(m, torch.nn.Linear)]

    def take(self) -> set[torch.dtype]:
        seen, self.seen = set(self.seen), []
        return seen


def _engine(model, **kw):
    from hf_verl.engine.accelerate_engine import AccelerateEngine

    return AccelerateEngine(model, role=kw.pop("role", "actor"), dims=ParallelDims(), backend=BackendSpec(), **kw)


def test_amp_dtype():
    assert amp_dtype(False, False) is None
    assert amp_dtype(True, False) is torch.bfloat16 and amp_dtype(False, True) is torch.float16
    with pytest.raises(ValueError, match="cannot both be set"):
        amp_dtype(True, True)


def test_bf16_engine_computes_in_bf16_and_keeps_fp32_weights_and_logprobs():
    tok = build_char_tokenizer()
    model = _model(tok)
    dtypes = MatmulDtypes(model)
    batch = _batch(tok)
    full, _ = _engine(model).logprobs(batch)
    assert dtypes.take() == {torch.float32}
    engine = _engine(model, bf16=True)
    logp, _ = engine.logprobs(batch)
    assert dtypes.take() == {torch.bfloat16}
    assert logp.dtype == torch.float32
    mask = batch.completion_mask.bool()
    # the same numbers to bf16's precision, and not bit-equal: the matmuls really ran in bf16
    torch.testing.assert_close(logp[mask], full[mask], rtol=0.05, atol=0.05)
    assert not torch.equal(logp[mask], full[mask])
    logp[mask].sum().backward()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters() if p.requires_grad)


def test_fp16_without_loss_scaling_is_refused_for_a_trained_role():
    tok = build_char_tokenizer()
    with pytest.raises(ValueError, match="fp16=True on the plain layout.*Use bf16=True"):
        _engine(_model(tok), fp16=True)
    frozen = _engine(_model(tok), role="reference", trainable=False, fp16=True)  # inference needs no scaling
    assert frozen.autocast_dtype is torch.float16


def test_transformers_engine_generates_under_autocast_with_fp32_logprobs():
    tok = build_char_tokenizer()
    model = _model(tok)
    dtypes = MatmulDtypes(model)
    engine = TransformersEngine(model, tok, autocast_dtype=torch.bfloat16)
    out = engine.generate([tok("abc")["input_ids"]] * 2, SamplingParams(max_new_tokens=4, seed=0))
    assert dtypes.take() == {torch.bfloat16}
    assert all(len(ids) == len(lps) for ids, lps in zip(out.completion_ids, out.logprobs))
    assert all(lp <= 0 for lps in out.logprobs for lp in lps)


def test_grpo_bf16_trains_under_autocast(tmp_path):
    from hf_verl.trainers.grpo_trainer import GRPOTrainer

    tok = build_char_tokenizer()
    model = _model(tok)
    dtypes = MatmulDtypes(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                          args=_args(tmp_path, bf16=True, max_steps=2, beta=0.1),
                          train_dataset=Dataset.from_dict({"prompt": ["abc", "xy"] * 4}), processing_class=tok)
    assert trainer.engine.autocast_dtype is torch.bfloat16 and trainer.actor.autocast_dtype is torch.bfloat16
    trainer.train()
    assert dtypes.take() == {torch.bfloat16}  # generation, reference and training forwards alike
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())
