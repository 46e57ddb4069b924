"""Algorithm functions against hand-computed values."""

import math

import pytest
import torch

from hf_verl.algorithms.advantages import grpo_advantages
from hf_verl.algorithms.kl import kl_penalty
from hf_verl.algorithms.logprobs import logprobs_from_hidden, logprobs_from_logits
from hf_verl.algorithms.policy_loss import aggregate_loss, masked_mean, ppo_clip_loss


def test_grpo_advantages_group_scaling_by_hand():
    r = torch.tensor([1.0, 0.0, 3.0, 3.0])
    adv, std = grpo_advantages(r, num_generations=2, scale_rewards="group", eps=1e-4)
    s = math.sqrt(0.5) + 1e-4  # unbiased std of (1, 0), plus eps
    assert torch.allclose(adv, torch.tensor([0.5 / s, -0.5 / s, 0.0, 0.0]))  # zero-std group -> 0
    s = math.sqrt(0.5)
    assert torch.allclose(std, torch.tensor([s, s, 0.0, 0.0]))


def test_grpo_advantages_batch_and_none():
    r = torch.tensor([1.0, 0.0, 3.0, 3.0])
    adv_none, _ = grpo_advantages(r, 2, "none")
    assert torch.allclose(adv_none, torch.tensor([0.5, -0.5, 0.0, 0.0]))
    adv_batch, _ = grpo_advantages(r, 2, "batch", eps=0.0)
    assert torch.allclose(adv_batch, adv_none / r.std())


def test_grpo_advantages_rejects_bad_group():
    with pytest.raises(ValueError, match="num_generations=3"):
        grpo_advantages(torch.zeros(4), 3)
    with pytest.raises(ValueError, match="scale_rewards"):
        grpo_advantages(torch.zeros(4), 2, "sometimes")


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([-1.0]), torch.tensor([-2.0])  # log_ratio = 1
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(1.0)
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.5)
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(math.exp(-1) - 1 + 1)
    assert kl_penalty(ref, ref, "k3").item() == 0.0
    with pytest.raises(ValueError, match="k4"):
        kl_penalty(logp, ref, "k4")


def test_ppo_clip_loss_by_hand():
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))  # ratios 1.5, 0.5, 1.1
    mask = torch.ones(1, 3)
    loss, st = ppo_clip_loss(logp, old, torch.tensor([1.0]), mask, 0.2, 0.28)
    # A>0: min(r*A, clip(r)*A): 1.28, 0.5, 1.1
    assert torch.allclose(loss, -torch.tensor([[1.28, 0.5, 1.1]]), atol=1e-6)
    assert st["high_clip"].tolist() == [[1.0, 0.0, 0.0]]
    loss_neg, st_neg = ppo_clip_loss(logp, old, torch.tensor([-1.0]), mask, 0.2)
    # A<0: -min(-r, -clip(r)) = max(r, clip(r)): 1.5, 0.8, 1.1
    assert torch.allclose(loss_neg, torch.tensor([[1.5, 0.8, 1.1]]), atol=1e-6)
    assert st_neg["low_clip"].tolist() == [[0.0, 1.0, 0.0]]


def test_dual_clip_caps_negative_advantage_loss():
    logp = torch.log(torch.tensor([[5.0, 1.0]]))
    loss, _ = ppo_clip_loss(logp, torch.zeros(1, 2), torch.tensor([-1.0]), torch.ones(1, 2), 0.2,
                            dual_clip=3.0)
    assert torch.allclose(loss, torch.tensor([[3.0, 1.0]]))
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_clip_loss(logp, logp, torch.tensor([1.0]), torch.ones(1, 2), 0.2, dual_clip=0.5)


def test_loss_aggregation_modes_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert aggregate_loss(loss, mask, "grpo").item() == pytest.approx((2.0 + 4.0) / 2)
    assert aggregate_loss(loss, mask, "bnpo").item() == pytest.approx(10.0 / 4)
    assert aggregate_loss(loss, mask, "dr_grpo", max_completion_length=5).item() == pytest.approx(1.0)
    assert aggregate_loss(loss, mask, "dapo", normalizer=8).item() == pytest.approx(1.25)
    assert aggregate_loss(loss, mask, "luspo").item() == pytest.approx((6.0 + 4.0) / 2)
    # verl's loss_agg_mode names are the same reductions
    assert aggregate_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx(5.0)
    assert aggregate_loss(loss, mask, "token-mean", normalizer=4).item() == pytest.approx(2.5)
    # a sequence-level loss (B, 1) broadcasts over its tokens
    seq = torch.tensor([[2.0], [4.0]])
    assert aggregate_loss(seq, mask, "bnpo").item() == pytest.approx((3 * 2.0 + 4.0) / 4)
    with pytest.raises(ValueError, match="unknown loss aggregation 'ppo'"):
        aggregate_loss(loss, mask, "ppo")
    assert masked_mean(loss, mask).item() == pytest.approx(2.5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_match_full_log_softmax(temperature):
    torch.manual_seed(0)
    hidden = torch.randn(2, 7, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    targets = torch.randint(0, 50, (2, 7))
    full = torch.log_softmax((hidden @ weight.T) / temperature, -1)
    ref_lp = full.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(full.exp() * full).sum(-1)
    lp, ent = logprobs_from_hidden(hidden, weight, targets, temperature=temperature, chunk_size=3,
                                   with_entropy=True)
    assert torch.allclose(lp, ref_lp, atol=1e-5) and torch.allclose(ent, ref_ent, atol=1e-5)
    g_ref = torch.autograd.grad(ref_lp.sum(), (hidden, weight))
    g = torch.autograd.grad(lp.sum(), (hidden, weight))
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(g, g_ref))
    lp2, _ = logprobs_from_logits((hidden @ weight.T).detach(), targets, temperature=temperature,
                                  chunk_size=4)
    assert torch.allclose(lp2, ref_lp.detach(), atol=1e-5)


def test_chunks_are_capped_by_logit_bytes_for_big_vocabularies():
    from hf_verl.algorithms.logprobs import chunk_positions, logprobs_from_head

    # a 152k vocabulary gets 441 positions a chunk within 256 MiB; up to 64k keeps the full 1024
    assert chunk_positions(1024, 151_936) == 441
    assert chunk_positions(1024, 65_536) == 1024 and chunk_positions(1024, None) == 1024
    assert chunk_positions(8, 10**12) == 1  # never fewer than one position
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        chunk_positions(0, 100)

    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(2, 7, 16, requires_grad=True)
    targets = torch.randint(0, 50, (2, 7))
    sizes = []
    head.register_forward_hook(lambda m, args, out: sizes.append(out.shape[0]))
    # 3 positions x 50 words x 4 bytes = 600 bytes: chunk_size=8 is cut to 3 (vocabulary read from the module)
    lp, ent, _ = logprobs_from_head(hidden, head, targets, chunk_size=8, with_entropy=True, max_chunk_bytes=600)
    assert sizes[:5] == [3, 3, 3, 3, 2]
    full = torch.log_softmax(head(hidden), -1)
    assert torch.allclose(lp, full.gather(-1, targets.unsqueeze(-1)).squeeze(-1), atol=1e-5)
    assert torch.allclose(ent, -(full.exp() * full).sum(-1), atol=1e-5)


def test_importance_weights_modes():
    import math

    from hf_verl.algorithms.importance import importance_weights

    old = torch.tensor([[0.0, -1.0, -2.0], [-1.0, -1.0, 0.0]])
    samp = torch.tensor([[-0.5, -1.0, -9.0], [-1.0, -3.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    tok, stats = importance_weights(old, samp, mask, "token_truncate", clip_max=3.0)
    assert torch.allclose(tok, torch.tensor([[math.exp(0.5), 1.0, 1.0], [1.0, 3.0, 1.0]]))  # e^2 truncated to 3
    assert stats["sampling/sampling_logp_difference/max"] == pytest.approx(2.0)
    seq, _ = importance_weights(old, samp, mask, "sequence_mask", clip_max=3.0)
    assert torch.allclose(seq, torch.tensor([[math.exp(0.5)], [0.0]]))  # e^2 > 3: masked out
    with pytest.raises(ValueError, match="unknown importance sampling mode"):
        importance_weights(old, samp, mask, "nope")
