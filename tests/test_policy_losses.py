"""Policy losses and estimators: hand-computed values, then parity with the peers' own functions on the same
batch: TRL 1.16's `GRPOTrainer._compute_loss` (every `loss_type`, GSPO, two-sided clipping, off-policy and
entropy masks, the bias-corrected KL) and verl 0.9.1's registered policy losses and estimators."""

import math
import types
from collections import defaultdict

import pytest
import torch

from hf_verl.algorithms.advantages import gdpo_advantages
from hf_verl.algorithms.estimators import (
    gdpo_token_advantages,
    gpg_advantages,
    grpo_passk_advantages,
    opo_advantages,
)
from hf_verl.algorithms.policy_loss import aggregate_loss
from hf_verl.algorithms.policy_losses import (
    PolicyLossParams,
    entropy_quantile,
    high_entropy_mask,
    off_policy_sequence_mask,
    resolve_policy_loss,
    vespo_weights,
)
from hf_verl.data.batch import RolloutBatch
from hf_verl.pipeline import losses

B, T, G = 8, 6, 4
LENGTHS = [6, 3, 5, 1, 4, 6, 2, 5]


def _batch(seed=0, adv_per_token=False):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(T)[None] < torch.tensor(LENGTHS)[:, None]).long()
    old = -torch.rand(B, T, generator=g) * 2
    logp = (old + 0.3 * torch.randn(B, T, generator=g)).requires_grad_()
    ref = old + 0.2 * torch.randn(B, T, generator=g)
    sampling = old + 0.1 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, T if adv_per_token else 1, generator=g).squeeze(-1) if not adv_per_token else \
        torch.randn(B, T, generator=g)
    entropy = torch.rand(B, T, generator=g) * 2
    return logp, old, ref, sampling, adv, mask, entropy


def _rollout(old, ref, sampling, adv, mask):
    batch = RolloutBatch(torch.ones(B, 2, dtype=torch.long), torch.ones(B, 2, dtype=torch.long),
                         torch.ones(B, T, dtype=torch.long), mask, old_logprobs=old, ref_logprobs=ref,
                         sampling_logprobs=sampling, advantages=adv)
    return batch.validate()


# ---------------------------------------------------------------------------------------------- by hand
def test_clip_delta_sapo_cispo_by_hand():
    logp, old = torch.tensor([[math.log(2.0)]]), torch.zeros(1, 1)
    mask = torch.ones(1, 1)
    p = PolicyLossParams(clip_low=0.2, clip_high=0.28)
    from hf_verl.algorithms.policy_losses import POLICY_LOSSES

    # ratio 2, A = -1: PPO takes the unclipped (pessimistic) 2; delta = 1.5 caps it
    loss, _ = POLICY_LOSSES["clip"](logp, old, torch.tensor([-1.0]), mask, p)
    assert loss.item() == pytest.approx(2.0)
    loss, _ = POLICY_LOSSES["clip"](logp, old, torch.tensor([-1.0]), mask, PolicyLossParams(delta=1.5))
    assert loss.item() == pytest.approx(1.5)
    # SAPO: -(4 / tau) sigmoid(tau (r - 1)) A with tau_pos = 1 for A > 0
    loss, _ = POLICY_LOSSES["sapo"](logp, old, torch.tensor([1.0]), mask, p)
    assert loss.item() == pytest.approx(-4.0 / (1.0 + math.exp(-1.0)))
    # TRL's CISPO: the weight is the ratio capped at epsilon_high (2 -> 0.28), times -A logp
    loss, st = POLICY_LOSSES["cispo"](logp, old, torch.tensor([1.0]), mask, p)
    assert loss.item() == pytest.approx(-0.28 * math.log(2.0)) and st["cispo_clip"].item() == 1.0
    # verl's cispo clips around 1 (2 -> 1.28)
    loss, _ = POLICY_LOSSES[resolve_policy_loss("cispo")](logp, old, torch.tensor([1.0]), mask, p)
    assert loss.item() == pytest.approx(-1.28 * math.log(2.0))


def test_gspo_carries_the_sequence_ratio_and_vespo_weight_is_one_on_policy():
    from hf_verl.algorithms.policy_losses import POLICY_LOSSES

    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.5, -2.1]])
    mask = torch.ones(1, 2)
    loss, _ = POLICY_LOSSES["gspo"](logp, old, torch.tensor([1.0]), mask, PolicyLossParams(clip_low=1.0, clip_high=1.0))
    assert loss.detach() == pytest.approx(-math.exp(0.3) * torch.ones(1, 2))  # mean log ratio (0.5 + 0.1) / 2
    phi = vespo_weights(torch.tensor([1.0]), torch.zeros(1, 2), mask, None, PolicyLossParams())
    assert phi.item() == pytest.approx(1.0)  # phi(1) = e^lambda * 1 * e^-lambda


def test_off_policy_and_entropy_masks_by_hand():
    adv = torch.tensor([1.0, -1.0, -1.0])
    logp = torch.tensor([[-2.0, -2.0], [-0.5, -0.5], [-2.0, -2.0]])
    keep = off_policy_sequence_mask(adv, logp, torch.zeros(3, 2), torch.ones(3, 2), 1.0)
    assert keep.squeeze(1).tolist() == [1.0, 1.0, 0.0]  # row 3: A < 0 and mean KL 2 > 1
    ent = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.7, 0.8, 0.9, 1.0, 1.1, 1.2]])
    mask = torch.tensor([[1] * 6, [1, 1, 1, 1, 0, 0]])
    values = ent[mask.bool()]
    out = high_entropy_mask(ent, mask, entropy_quantile(values, 0.8))
    assert out.nonzero().tolist() == [[1, 2], [1, 3]]  # only 0.9 and 1.0 (TRL's expectation)
    assert not high_entropy_mask(ent, torch.zeros_like(mask), entropy_quantile(values[:0], 0.5)).any()


def test_new_estimators_by_hand():
    scores = torch.tensor([1.0, 0.0, 0.0, 3.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]])
    # GPG: alpha = 4 / 2 rewarded; group means 0.5 and 1.5
    assert gpg_advantages(scores, 2).tolist() == pytest.approx([1.0, -1.0, -3.0, 3.0])
    # pass@k: only each group's best gets (r1 - r2) / std
    std = torch.tensor([1.0, 0.0]).std().item()
    assert grpo_passk_advantages(scores, 2, scale_by_std=False).tolist() == [1.0, 0.0, 0.0, 3.0]
    assert grpo_passk_advantages(scores, 2)[0].item() == pytest.approx(1.0 / (std + 1e-6))
    # OPO: length-weighted baseline (2 * 1 + 1 * 0) / 3 and (3 * 0 + 1 * 3) / 4
    assert opo_advantages(scores, 2, mask)[:, 0].tolist() == pytest.approx([1 / 3, -2 / 3, -0.75, 2.25])
    adv = gdpo_token_advantages(scores, 2, mask)
    assert (adv[mask == 0] == 0).all() and adv[mask.bool()].mean().abs() < 1e-6
    # TRL's normalize_then_sum with one function: group z-scores, then batch-normalised
    a, _ = gdpo_advantages(scores.unsqueeze(1), 2)
    assert a.tolist() == pytest.approx([0.866, -0.866, -0.866, 0.866], abs=1e-3)


# ---------------------------------------------------------------------------------------------- TRL parity
TRL_CASES = [
    dict(loss_type=t) for t in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo")
] + [
    dict(loss_type="grpo", importance_sampling_level="sequence"),
    dict(loss_type="luspo", importance_sampling_level="sequence"),
    dict(loss_type="dapo", delta=1.3, epsilon_high=0.28),
    dict(loss_type="dapo", beta=0.04),
    dict(loss_type="grpo", beta=0.04, use_bias_correction_kl=False),
    dict(loss_type="bnpo", off_policy_mask_threshold=0.05),
    dict(loss_type="dapo", top_entropy_quantile=0.5),
    dict(loss_type="cispo", epsilon_high=5.0),
]


def _trl_loss(case, logp, old, ref, sampling, adv, mask, entropy):
    trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
    cls = trl_grpo.GRPOTrainer
    args = types.SimpleNamespace(delta=case.get("delta"), use_bias_correction_kl=case.get("use_bias_correction_kl", True),
                                 steps_per_generation=1, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
                                 vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0)
    acc = types.SimpleNamespace(num_processes=1, gather=lambda x: x, reduce=lambda x, reduction="sum": x,
                                gather_for_metrics=lambda x: x, pad_across_processes=lambda x, dim=0, pad_index=0: x,
                                sync_gradients=True)
    fake = types.SimpleNamespace(
        args=args, accelerator=acc, model=types.SimpleNamespace(training=True), aux_loss_enabled=False,
        beta=case.get("beta", 0.0), current_gradient_accumulation_steps=1, epsilon_low=0.2,
        epsilon_high=case.get("epsilon_high", 0.2), importance_sampling_level=case.get("importance_sampling_level", "token"),
        loss_type=case["loss_type"], max_completion_length=T,
        off_policy_mask_threshold=case.get("off_policy_mask_threshold"),
        top_entropy_quantile=case.get("top_entropy_quantile", 1.0), use_vllm=False,
        vllm_importance_sampling_correction=False, _entropy_bonus_enabled=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        get_off_policy_mask=cls.get_off_policy_mask, get_gamma_weights=cls.get_gamma_weights,
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, entropy, None))
    fake.get_high_entropy_mask = lambda e, m, t: cls.get_high_entropy_mask(fake, e, m, t)
    inputs = {"prompt_ids": torch.ones(B, 2, dtype=torch.long), "prompt_mask": torch.ones(B, 2, dtype=torch.long),
              "completion_ids": torch.ones(B, T, dtype=torch.long), "completion_mask": mask, "advantages": adv,
              "num_items_in_batch": mask.sum().float(), "old_per_token_logps": old, "ref_per_token_logps": ref,
              "sampling_per_token_logps": sampling}
    return cls._compute_loss(fake, None, inputs)


@pytest.mark.parametrize("case", TRL_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_grpo_losses_match_trl(case):
    logp, old, ref, sampling, adv, mask, entropy = _batch(1)
    expected = _trl_loss(case, logp, old, ref, sampling, adv, mask, entropy)
    (grad_trl,) = torch.autograd.grad(expected, logp)
    config = types.SimpleNamespace(loss_type=case["loss_type"], policy_loss=None, epsilon=0.2,
                                   epsilon_high=case.get("epsilon_high", 0.2), delta=case.get("delta"),
                                   importance_sampling_level=case.get("importance_sampling_level", "token"))
    batch = _rollout(old, ref, sampling, adv, mask)
    q = case.get("top_entropy_quantile", 1.0)
    threshold = entropy_quantile(entropy[mask.bool()], 1.0 - q) if q < 1 else None
    ours, _ = losses.policy_loss(
        logp, batch, loss=losses.loss_form(config), params=losses.loss_params(config), loss_type=case["loss_type"],
        normalizer=float(mask.sum()), max_completion_length=T, kl_coef=case.get("beta", 0.0),
        kl_bias_correction=case.get("use_bias_correction_kl", True), entropy=entropy, entropy_threshold=threshold,
        off_policy_threshold=case.get("off_policy_mask_threshold"))
    (grad_ours,) = torch.autograd.grad(ours, logp)
    assert ours.item() == pytest.approx(expected.item(), abs=1e-6)
    torch.testing.assert_close(grad_ours, grad_trl, atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------------------------------------- verl parity
def _verl():
    return pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl 0.9.1 (scripts/install.sh) not installed")


def _verl_config(**kw):
    from verl.workers.config import ActorConfig, PolicyLossConfig

    pl = PolicyLossConfig(**kw.pop("policy_loss", {}))
    base = dict(strategy="fsdp", rollout_n=G, ppo_micro_batch_size_per_gpu=1, clip_ratio=0.2, clip_ratio_low=0.2,
                clip_ratio_high=0.28, clip_ratio_c=3.0, global_batch_info={})
    base.update(kw)
    return ActorConfig(policy_loss=pl, **base)


VERL_LOSSES = [
    ("vanilla", "token-mean", {}, {"dual_clip": 3.0}),
    ("vanilla", "seq-mean-token-mean", {}, {"dual_clip": 3.0}),
    ("gspo", "seq-mean-token-mean", {}, {}),
    ("gspo", "token-mean", {}, {}),
    ("sapo", "seq-mean-token-mean", {}, {}),
    ("cispo", "token-mean", {}, {}),
    ("gpg", "token-mean", {}, {}),
    ("dppo_tv", "token-mean", {}, {"dual_clip": 3.0}),
    ("dppo_kl", "seq-mean-token-sum", {}, {"dual_clip": 3.0}),
    ("geo_mean", "seq-mean-token-mean", {}, {}),
    ("dro", "token-mean", {"policy_loss": {"dro_beta": 0.5}}, {"dro_beta": 0.5}),
    ("kl_cov", "token-mean", {"policy_loss": {"kl_cov_ratio": 0.2, "ppo_kl_coef": 0.1}},
     {"kl_cov_ratio": 0.2, "kl_cov_coef": 0.1}),
    ("clip_cov", "token-mean", {"policy_loss": {"clip_cov_ratio": 0.1, "clip_cov_lb": -10.0, "clip_cov_ub": 10.0}},
     {"clip_cov_ratio": 0.1, "clip_cov_lb": -10.0, "clip_cov_ub": 10.0}),
]


@pytest.mark.parametrize("name,agg,verl_kw,our_kw", VERL_LOSSES, ids=[f"{c[0]}-{c[1]}" for c in VERL_LOSSES])
def test_policy_losses_match_verl(name, agg, verl_kw, our_kw):
    core = _verl()
    logp, old, _, _, adv, mask, _ = _batch(2, adv_per_token=True)
    fn = core.get_policy_loss_fn(name)
    torch.manual_seed(7)  # clip_cov draws its tokens from the global generator, on both sides
    expected, _ = fn(old_log_prob=old, log_prob=logp, advantages=adv, response_mask=mask.bool(), loss_agg_mode=agg,
                     config=_verl_config(**verl_kw))
    (grad_verl,) = torch.autograd.grad(expected, logp)
    form = resolve_policy_loss(name)
    params = PolicyLossParams(clip_low=0.2, clip_high=0.28, **our_kw)
    from hf_verl.algorithms.policy_losses import POLICY_LOSSES

    torch.manual_seed(7)
    per_token, _ = POLICY_LOSSES[form](logp, old, adv, mask, params)
    ours = aggregate_loss(per_token, mask, agg, normalizer=float(mask.sum()), max_completion_length=T)
    (grad_ours,) = torch.autograd.grad(ours, logp)
    assert ours.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-6)
    torch.testing.assert_close(grad_ours, grad_verl, atol=1e-6, rtol=1e-5)


def _verl_advantages(name, scores, mask, config=None):
    import numpy as np

    core = _verl()
    rewards = torch.zeros(B, T)
    rewards[torch.arange(B), mask.sum(1) - 1] = scores
    index = np.array([i // G for i in range(B)], dtype=object)
    adv, _ = core.get_adv_estimator_fn(name)(token_level_rewards=rewards, response_mask=mask.float(), index=index,
                                             config=config)
    return adv


@pytest.mark.parametrize("name", ["gpg", "grpo_passk", "opo", "gdpo"])
def test_estimators_match_verl(name):
    g = torch.Generator().manual_seed(3)
    scores = torch.randint(0, 3, (B,), generator=g).float()
    scores[:G] = torch.tensor([1.0, 0.0, 2.0, 0.0])  # no ties at the top of group 0
    mask = (torch.arange(T)[None] < torch.tensor(LENGTHS)[:, None]).long()
    config = {"norm_adv_by_std_in_grpo": True} if name == "grpo_passk" else None
    expected = _verl_advantages(name, scores, mask, config)
    ours = {"gpg": lambda: gpg_advantages(scores, G, mask), "grpo_passk": lambda: grpo_passk_advantages(scores, G, mask),
            "opo": lambda: opo_advantages(scores, G, mask), "gdpo": lambda: gdpo_token_advantages(scores, G, mask)}[name]()
    torch.testing.assert_close(ours, expected.to(ours.dtype), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name,gap", [("optimal_token_baseline", False), ("tir_optimal_token_baseline", True)])
def test_optimal_token_baseline_matches_verl(name, gap):
    import numpy as np

    from hf_verl.algorithms.estimators import optimal_token_baseline_advantages

    core = _verl()
    g = torch.Generator().manual_seed(9)
    mask = (torch.arange(T)[None] < torch.tensor(LENGTHS)[:, None]).long()
    if gap:  # tool observations: trained tokens with a hole in the middle
        mask[0, 2:4] = 0
        mask[5, 1] = 0
    rewards = torch.zeros(B, T)
    last = T - 1 - mask.flip(-1).argmax(-1)
    rewards[torch.arange(B), last] = torch.randint(0, 2, (B,), generator=g).float()
    old = -torch.rand(B, T, generator=g) * 2
    sum_sq = torch.rand(B, T, generator=g) * 0.5
    index = np.array([i // G for i in range(B)], dtype=object)
    expected, ret = core.get_adv_estimator_fn(name)(token_level_rewards=rewards, response_mask=mask.float(), index=index,
                                                    old_log_probs=old, sum_pi_squared=sum_sq)
    ours, returns = optimal_token_baseline_advantages(rewards, mask, old, sum_sq, G, multi_turn=gap)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(returns, ret, atol=1e-6, rtol=1e-6)
