"""Advantage estimators, token rewards, whitening and KL controllers against hand-computed values.

Expected numbers are built with plain Python loops and arithmetic, never by the functions under
test. Masks have rows of different lengths (right padding).
"""

import math

import pytest
import torch

from hf_verl.algorithms.estimators import (
    ADVANTAGE_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    compute_advantages,
    dr_grpo_advantages,
    gae_advantages,
    masked_whiten,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    remax_advantages,
    rloo_advantages,
    token_level_rewards,
)

LENGTHS = [3, 1, 4, 2]
T = 4
MASK = torch.tensor([[1.0 if t < n else 0.0 for t in range(T)] for n in LENGTHS])
SCORES = [1.0, 0.0, 2.0, 5.0]


def _whiten_list(rows, lengths, shift_mean=True, eps=1e-8):
    """Plain-Python masked whitening with the unbiased variance."""
    vals = [rows[b][t] for b in range(len(rows)) for t in range(lengths[b])]
    n = len(vals)
    mean = sum(vals) / n
    var = sum((v - mean) ** 2 for v in vals) / (n - 1)
    out = [[(x - mean) / math.sqrt(var + eps) for x in row] for row in rows]
    if not shift_mean:
        out = [[x + mean for x in row] for row in out]
    return out


def _broadcast_list(per_seq, lengths):
    return [[per_seq[b] if t < lengths[b] else 0.0 for t in range(T)] for b in range(len(lengths))]


def _close(actual, expected, atol=1e-5):
    assert torch.allclose(actual, torch.tensor(expected, dtype=actual.dtype), atol=atol), (actual, expected)


def test_masked_whiten_by_hand():
    rows = [[1.0, 2.0, 3.0, 99.0], [4.0, -50.0, -50.0, -50.0]]
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    # masked entries 1, 2, 3, 4: mean 2.5, unbiased var 5/3
    out = masked_whiten(torch.tensor(rows), mask)
    s = math.sqrt(5 / 3 + 1e-8)
    assert math.isclose(out[0, 0].item(), (1 - 2.5) / s, rel_tol=1e-5)
    _close(out, _whiten_list(rows, [3, 1]))
    _close(masked_whiten(torch.tensor(rows), mask, shift_mean=False), _whiten_list(rows, [3, 1], False))
    assert masked_mean_of(out, mask) == pytest.approx(0.0, abs=1e-6)


def masked_mean_of(x, mask):
    return ((x * mask).sum() / mask.sum()).item()


def test_masked_whiten_needs_two_entries():
    with pytest.raises(ValueError, match="at least 2"):
        masked_whiten(torch.ones(2, 3), torch.tensor([[1, 0, 0], [0, 0, 0]]))


def test_gae_by_hand():
    gamma, lam = 0.9, 0.8
    rewards = [[0.1, -0.2, 1.0, 7.0], [2.0, 7.0, 7.0, 7.0], [0.0, 0.5, 0.0, 1.5], [0.3, 0.4, 7.0, 7.0]]
    values = [[0.5, 0.4, 0.3, 9.0], [1.0, 9.0, 9.0, 9.0], [0.2, -0.1, 0.6, 0.4], [0.7, 0.2, 9.0, 9.0]]
    exp_adv, exp_ret = [], []
    for b, n in enumerate(LENGTHS):
        adv = [0.0] * T
        last = 0.0
        for t in reversed(range(n)):
            v_next = values[b][t + 1] if t + 1 < n else 0.0
            delta = rewards[b][t] + gamma * v_next - values[b][t]
            last = delta + gamma * lam * last
            adv[t] = last
        exp_adv.append(adv)
        exp_ret.append([adv[t] + values[b][t] if t < n else 0.0 for t in range(T)])
    adv, ret = gae_advantages(torch.tensor(rewards), torch.tensor(values), MASK, gamma, lam)
    _close(adv, exp_adv)
    _close(ret, exp_ret)
    # one spot check written out: row 1 has a single token, A = r - V = 2 - 1
    assert adv[1, 0].item() == pytest.approx(1.0)


def test_gae_lambda_one_gamma_one_is_return_minus_value():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.2, 0.5, 0.7]])
    adv, ret = gae_advantages(rewards, values, torch.ones(1, 3), 1.0, 1.0)
    _close(adv, [[0.8, 0.5, 0.3]])
    _close(ret, [[1.0, 1.0, 1.0]])


def test_token_level_rewards_by_hand():
    kl = [[0.1, 0.2, 0.3, 5.0], [0.4, 5.0, 5.0, 5.0], [0.0, -0.1, 0.2, 0.1], [0.5, 0.5, 5.0, 5.0]]
    coef = 0.5
    exp_non = [[-coef * kl[b][t] if t < n else 0.0 for t in range(T)] for b, n in enumerate(LENGTHS)]
    exp_tok = [row[:] for row in exp_non]
    for b, n in enumerate(LENGTHS):
        exp_tok[b][n - 1] += SCORES[b]
    tok, non = token_level_rewards(torch.tensor(SCORES), MASK, torch.tensor(kl), coef)
    _close(tok, exp_tok)
    _close(non, exp_non)
    tok, non = token_level_rewards(torch.tensor(SCORES), MASK)
    _close(tok, [[SCORES[b] if t == n - 1 else 0.0 for t in range(T)] for b, n in enumerate(LENGTHS)])
    _close(non, [[0.0] * T] * 4)


def test_token_level_rewards_empty_row_gets_no_score():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    tok, _ = token_level_rewards(torch.tensor([2.0, 3.0]), mask)
    _close(tok, [[0.0, 2.0, 0.0], [0.0, 0.0, 0.0]])


def test_rloo_by_hand():
    # groups (1, 0) and (2, 5): leave-one-out baseline is the other member for G=2
    _close(rloo_advantages(torch.tensor(SCORES), 2, MASK), _broadcast_list([1.0, -1.0, -3.0, 3.0], LENGTHS))
    r = [1.0, 2.0, 6.0]
    exp = [r[i] - (sum(r) - r[i]) / 2 for i in range(3)]
    _close(rloo_advantages(torch.tensor(r), 3), exp)
    with pytest.raises(ValueError, match="num_generations >= 2"):
        rloo_advantages(torch.tensor(r), 1)


def test_reinforce_pp_by_hand():
    gamma = 0.9
    rewards = [[0.1, -0.2, 1.0, 7.0], [2.0, 7.0, 7.0, 7.0], [0.0, 0.5, 0.0, 1.5], [0.3, 0.4, 7.0, 7.0]]
    returns = []
    for b, n in enumerate(LENGTHS):
        row, run = [0.0] * T, 0.0
        for t in reversed(range(n)):
            run = rewards[b][t] + gamma * run
            row[t] = run
        returns.append(row)
    w = _whiten_list(returns, LENGTHS)
    exp = [[w[b][t] if t < n else 0.0 for t in range(T)] for b, n in enumerate(LENGTHS)]
    _close(reinforce_pp_advantages(torch.tensor(rewards), MASK, gamma), exp)


def test_reinforce_pp_baseline_by_hand():
    centred = [0.5, -0.5, -1.5, 1.5]  # SCORES minus group means 0.5 and 3.5
    w = _whiten_list(_broadcast_list(centred, LENGTHS), LENGTHS)
    exp = [[w[b][t] if t < n else 0.0 for t in range(T)] for b, n in enumerate(LENGTHS)]
    _close(reinforce_pp_baseline_advantages(torch.tensor(SCORES), MASK, 2), exp)


def test_remax_by_hand():
    greedy = [0.5, 0.5, 4.0, 4.0]
    exp = _broadcast_list([SCORES[i] - greedy[i] for i in range(4)], LENGTHS)
    _close(remax_advantages(torch.tensor(SCORES), torch.tensor(greedy), MASK), exp)
    with pytest.raises(ValueError, match="greedy_scores shape"):
        remax_advantages(torch.tensor(SCORES), torch.tensor([1.0, 2.0]), MASK)


def test_dr_grpo_by_hand():
    _close(dr_grpo_advantages(torch.tensor(SCORES), 2, MASK), _broadcast_list([0.5, -0.5, -1.5, 1.5], LENGTHS))
    _close(dr_grpo_advantages(torch.tensor(SCORES), 4), [s - 2.0 for s in SCORES])


def test_compute_advantages_dispatch():
    scores = torch.tensor(SCORES)
    adv, ret = compute_advantages("dr_grpo", scores=scores, mask=MASK, num_generations=2)
    _close(adv, _broadcast_list([0.5, -0.5, -1.5, 1.5], LENGTHS))
    assert ret is None
    std = [math.sqrt(0.5), math.sqrt(0.5), math.sqrt(4.5), math.sqrt(4.5)]
    grpo = [(SCORES[i] - [0.5, 0.5, 3.5, 3.5][i]) / (std[i] + 1e-4) for i in range(4)]
    adv, _ = compute_advantages("grpo", scores=scores, mask=MASK, num_generations=2)
    _close(adv, _broadcast_list(grpo, LENGTHS))
    adv, _ = compute_advantages("rloo", scores=scores, mask=MASK, num_generations=2)
    _close(adv, _broadcast_list([1.0, -1.0, -3.0, 3.0], LENGTHS))
    adv, _ = compute_advantages("remax", scores=scores, greedy_scores=scores - 1, mask=MASK)
    _close(adv, _broadcast_list([1.0] * 4, LENGTHS))
    tok = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    vals = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 9.0]])
    adv, ret = compute_advantages("gae", token_rewards=tok, values=vals, mask=mask, lam=1.0)
    _close(adv, [[0.9, 0.8, 0.7], [1.6, 1.5, 0.0]])
    _close(ret, [[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]])
    adv, ret = compute_advantages("reinforce_plus_plus", token_rewards=tok, mask=mask)
    assert ret is None and adv[1, 2].item() == 0.0
    assert set(ADVANTAGE_ESTIMATORS) == {"gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
                                         "remax", "dr_grpo", "gpg", "grpo_passk", "opo", "gdpo",
                                         "optimal_token_baseline", "tir_optimal_token_baseline"}


@pytest.mark.parametrize(
    "name, kwargs, message",
    [
        ("gae", {"token_rewards": torch.zeros(4, 4)}, "estimator 'gae' needs values \\(a critic\\)"),
        ("gae", {"values": torch.zeros(4, 4)}, "estimator 'gae' needs token_rewards"),
        ("reinforce_plus_plus", {"scores": torch.zeros(4)}, "needs token_rewards"),
        ("grpo", {"scores": torch.zeros(4)}, "'grpo' needs num_generations"),
        ("rloo", {"token_rewards": torch.zeros(4, 4)}, "'rloo' needs scores"),
        ("remax", {"scores": torch.zeros(4)}, "'remax' needs greedy_scores"),
        ("dr_grpo", {"scores": torch.zeros(4), "num_generations": 3}, "does not split into groups"),
        ("reinforce_plus_plus_baseline", {"scores": torch.zeros(4), "num_generations": 0},
         "does not split into groups"),
        ("ppo", {"scores": torch.zeros(4)}, "unknown advantage estimator 'ppo'.*'gae', 'grpo'"),
        ("grpo", {"scores": torch.zeros(3), "num_generations": 1}, "mask must be"),
    ],
)
def test_compute_advantages_errors(name, kwargs, message):
    with pytest.raises(ValueError, match=message):
        compute_advantages(name, mask=MASK, **kwargs)


def test_kl_controllers_by_hand():
    fixed = FixedKLController(0.05)
    fixed.update(10.0, 256)
    assert fixed.value == 0.05
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    ctl.update(12.0, 256)  # error 1.0 clipped to 0.2
    expected = 0.1 * (1 + 0.2 * 256 / 10000)
    assert ctl.value == pytest.approx(expected)
    ctl.update(5.4, 100)  # error -0.1, inside the clip
    expected *= 1 + (-0.1) * 100 / 10000
    assert ctl.value == pytest.approx(expected)
    ctl.update(0.0, 1000)  # error -1 clipped to -0.2
    expected *= 1 - 0.2 * 1000 / 10000
    assert ctl.value == pytest.approx(expected)
    with pytest.raises(ValueError, match="target and horizon"):
        AdaptiveKLController(0.1, target=0.0, horizon=1)


# ------------------------------------------------------------------------ multi-turn masks (verl parity)
# Response masks with holes: 0 on tool observations between the model's turns, then right padding.
HOLEY_MASK = torch.tensor([[1, 1, 1, 0, 0, 1, 1, 0, 0, 0],
                           [1, 0, 0, 1, 0, 0, 1, 1, 1, 1],
                           [1, 1, 1, 1, 0, 0, 0, 0, 0, 0]])


def test_token_level_rewards_score_on_the_last_valid_token_of_a_holey_mask():
    rewards, _ = token_level_rewards(torch.tensor([1.0, 2.0, 3.0]), HOLEY_MASK)
    expected = torch.zeros(3, 10)
    expected[0, 6], expected[1, 9], expected[2, 3] = 1.0, 2.0, 3.0
    torch.testing.assert_close(rewards, expected)


def test_multi_turn_masks_match_verl():
    from types import SimpleNamespace

    core = pytest.importorskip("verl.trainer.ppo.core_algos")
    g = torch.Generator().manual_seed(0)
    mask = HOLEY_MASK
    values = torch.randn(mask.shape, generator=g)
    token_rewards = torch.randn(mask.shape, generator=g)  # nonzero on masked positions too: they must not count
    on = mask.bool()

    expected_adv, expected_ret = core.compute_gae_advantage_return(token_rewards, values, mask.float(), 0.9, 0.8)
    adv, ret = gae_advantages(token_rewards, values, mask, gamma=0.9, lam=0.8)
    # verl whitens its GAE advantages inside; ours are whitened by the caller
    torch.testing.assert_close(masked_whiten(adv, mask)[on], expected_adv[on], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret[on], expected_ret[on], atol=1e-6, rtol=1e-6)
    assert (adv[~on] == 0).all() and (ret[~on] == 0).all()

    expected_pp, _ = core.compute_reinforce_plus_plus_outcome_advantage(token_rewards, mask.float(),
                                                                        config=SimpleNamespace(gamma=0.9))
    torch.testing.assert_close(reinforce_pp_advantages(token_rewards, mask, gamma=0.9), expected_pp, atol=1e-5,
                               rtol=1e-5)

    # outcome rewards on the last valid token, as both place them
    scores = torch.tensor([1.0, -0.5, 2.0])
    outcome, _ = token_level_rewards(scores, mask)
    expected_adv, _ = core.compute_gae_advantage_return(outcome, values, mask.float(), 1.0, 0.95)
    adv, _ = gae_advantages(outcome, values, mask, gamma=1.0, lam=0.95)
    torch.testing.assert_close(masked_whiten(adv, mask)[on], expected_adv[on], atol=1e-5, rtol=1e-5)
    # with gamma = lam = 1 the advantage of every model token is the score minus its value: the observation span
    # neither discounts nor adds anything
    adv, _ = gae_advantages(outcome, values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv[on], (scores[:, None] - values)[on], atol=1e-6, rtol=1e-6)
