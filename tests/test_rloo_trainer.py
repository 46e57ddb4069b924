"""RLOOTrainer: TRL 1.16's RLOO on the shared pipeline, one more algorithm object (hf_verl/pipeline/rloo.py).

The round's arithmetic is checked against TRL's own formulas written out here (unscorable completions, reward
clipping, the sequence-level k1 reward penalty, the leave-one-out baseline, whitening), the loss against TRL's
per-sequence PPO-clip, and a short run trains every parameter with TRL's metric names.
"""

import math

import pytest
import torch
from datasets import Dataset

from hf_verl.algorithms.policy_losses import POLICY_LOSSES, PolicyLossParams
from hf_verl.data.batch import RolloutBatch
from hf_verl.parallel.dims import ParallelDims
from hf_verl.pipeline.algorithm import Roles
from hf_verl.pipeline.families import make_algorithm
from tests.conftest import build_char_tokenizer
from tests.test_grpo_trainer import _model, text_reward


def _config(tmp_path, **kw):
    from hf_verl import RLOOConfig

    base = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=3, logging_steps=1,
                per_device_train_batch_size=4, num_generations=4, max_completion_length=6, learning_rate=1e-2,
                gradient_checkpointing=False, save_strategy="no")
    return RLOOConfig(**{**base, **kw})


def _trl_advantages(per_func, weights, old, ref, mask, beta, group, clip=None, normalize=False):
    """TRL 1.16 RLOOTrainer._generate_and_score_completions' reward and advantage lines, on one process."""
    unscorable = torch.isnan(per_func).all(dim=1)
    rewards = (per_func * torch.tensor(weights).unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = torch.nan
    if clip:
        rewards = rewards.clamp(min=clip[0], max=clip[1])
    if beta:
        rewards = rewards - beta * ((old - ref) * mask).sum(-1)
    grouped = rewards.view(-1, group)
    counts = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    baselines = ((torch.nansum(grouped, dim=1, keepdim=True) - grouped) / (counts - 1)).view(-1)
    advantages = rewards - baselines
    if normalize:
        mean = torch.nanmean(advantages)
        std = torch.nansum((advantages - mean) ** 2) / ((~advantages.isnan()).sum() - 1)
        advantages = (advantages - mean) / (std.sqrt() + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0), rewards


@pytest.mark.parametrize("beta, clip, normalize", [(0.0, None, False), (0.05, None, False), (0.1, (0.0, 1.5), True)])
def test_the_round_is_trls_rloo(tmp_path, beta, clip, normalize):
    torch.manual_seed(0)
    B, T, G = 8, 5, 4
    mask = (torch.arange(T) < torch.tensor([5, 3, 4, 1, 5, 2, 5, 4]).unsqueeze(1)).long()
    old, ref = -torch.rand(B, T), -torch.rand(B, T)
    per_func = torch.rand(B, 2) * 2
    per_func[1] = float("nan")  # every source left completion 1 unscored: out of its siblings' baselines, advantage 0
    per_func[6, 0] = float("nan")  # one source left completion 6 unscored: scored by the other
    batch = RolloutBatch(prompt_ids=torch.ones(B, 2, dtype=torch.long), prompt_mask=torch.ones(B, 2, dtype=torch.long),
                         completion_ids=torch.ones(B, T, dtype=torch.long), completion_mask=mask.clone(),
                         old_logprobs=old.clone(), ref_logprobs=ref.clone(), is_truncated=torch.zeros(B, dtype=torch.bool))
    config = _config(tmp_path, beta=beta, num_generations=G, reward_clip_range=clip, normalize_advantages=normalize,
                     reward_weights=[1.0, 0.5])
    algorithm = make_algorithm(config, critic=False, reward_names=["a", "b"])
    assert type(algorithm).__name__ == "RLOOAlgorithm" and algorithm.kl_coef() == 0.0  # the KL is in the reward
    algorithm.finish_round(batch, per_func, Roles(actor=None, dims=ParallelDims.data_parallel(1, 0, shard=False)),
                           rows=[{}] * B)
    want, _ = _trl_advantages(per_func, [1.0, 0.5], old, ref, mask, beta, G, clip, normalize)
    torch.testing.assert_close(batch.advantages, want)
    assert batch.advantages[1] == 0.0
    metrics = algorithm.take_metrics()
    weighted = (per_func * torch.tensor([1.0, 0.5])).nansum(1)
    weighted[1] = float("nan")  # TRL logs the sources' weighted sum: no clipping, no KL penalty, unscorable left out
    assert metrics["reward"] == pytest.approx(torch.nanmean(weighted).item(), rel=1e-6)
    if beta:
        assert metrics["kl"] == pytest.approx((((old - ref) * mask).sum() / mask.sum()).item(), rel=1e-6)
    else:
        assert "kl" not in metrics


def test_the_loss_is_trls_sequence_clip():
    """TRL's RLOO loss: `-min(r A, clip(r) A)` per sequence with `r = exp(sum_t logp_t - sum_t old_t)`, then a mean
    over sequences; hf_verl's `sequence_clip` with the `grpo` aggregation, value and gradient."""
    from hf_verl.algorithms.policy_loss import aggregate_loss

    torch.manual_seed(1)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    logp = (-torch.rand(3, 4)).requires_grad_()
    old = logp.detach() + 0.1 * torch.randn(3, 4)
    adv = torch.tensor([1.0, -0.5, 2.0])
    ratio = torch.exp((logp * mask).sum(1) - (old * mask).sum(1))
    want = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()
    per_seq, stats = POLICY_LOSSES["sequence_clip"](logp, old, adv, mask, PolicyLossParams(clip_low=0.2))
    got = aggregate_loss(per_seq, mask, "grpo")
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.autograd.grad(got, logp)[0], torch.autograd.grad(want, logp)[0])
    assert per_seq.shape == (3, 1) and set(stats) == {"low_clip", "high_clip", "region_clip"}


@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_rloo_trains_every_parameter_with_trls_metrics(tmp_path, beta):
    from hf_verl import RLOOTrainer

    tok = build_char_tokenizer()
    model = _model(tok)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = RLOOTrainer(model=model, reward_funcs=text_reward, args=_config(tmp_path, beta=beta),
                          train_dataset=Dataset.from_dict({"prompt": ["abc", "xyz", "hello", "ab"] * 2}),
                          processing_class=tok)
    assert (trainer.reference is not None) == (beta > 0)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 3 and all(math.isfinite(h["loss"]) for h in logs)
    for key in ("reward", "reward_std", "frac_reward_zero_std", "rewards/text_reward/mean", "entropy",
                "clip_ratio/region_mean", "completions/mean_length"):
        assert key in logs[-1], key
    assert ("kl" in logs[-1]) == (beta > 0)
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert len(changed) == len(before), set(before) - set(changed)
    assert "rloo" in model.model_tags


def test_rloo_config_refuses_what_rloo_does_not_run(tmp_path):
    from hf_verl import GRPOConfig, RLOOTrainer

    with pytest.raises(ValueError, match="RLOOTrainer runs the leave-one-out baseline"):
        _config(tmp_path, advantage_estimator="grpo")
    with pytest.raises(ValueError, match="reward_clip_range must be \\(min, max\\) with min <= max"):
        _config(tmp_path, reward_clip_range=(2.0, 1.0))
    with pytest.raises(TypeError, match="RLOOTrainer takes an RLOOConfig, got GRPOConfig"):
        RLOOTrainer(model=_model(build_char_tokenizer()), reward_funcs=text_reward,
                    args=GRPOConfig(output_dir=str(tmp_path), use_cpu=True))
