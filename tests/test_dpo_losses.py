"""DPO loss family: each loss vs values computed by hand with `math`, gradients, combinations, errors, and
parity with TRL's `DPOTrainer._compute_loss` (run on a stub trainer and a stub model) where TRL is importable."""

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from hf_verl.algorithms.dpo_losses import (
    DPO_LOSS_TYPES,
    F_DIVERGENCE_LOSS_TYPES,
    combined_dpo_loss,
    dpo_loss,
    f_divergence_scores,
    implicit_rewards,
    reward_metrics,
)

PC, PR = [-1.0, -2.0, -3.5], [-1.5, -1.0, -4.0]  # policy chosen / rejected
RC, RR = [-1.2, -2.5, -3.0], [-1.1, -1.4, -4.4]  # reference chosen / rejected
C = [p - q for p, q in zip(PC, RC)]  # chosen log-ratios  [0.2, 0.5, -0.5]
R = [p - q for p, q in zip(PR, RR)]  # rejected log-ratios [-0.4, 0.4, 0.4]
BETA = 0.5
LEN_C, LEN_R = [2.0, 4.0, 1.0], [3.0, 1.0, 5.0]


def logsig(x):
    return -math.log1p(math.exp(-x))


def sig(x):
    return 1.0 / (1.0 + math.exp(-x))


def inputs(requires_grad=False):
    pc, pr = torch.tensor(PC, requires_grad=requires_grad), torch.tensor(PR, requires_grad=requires_grad)
    return pc, pr, torch.tensor(RC), torch.tensor(RR)


def expected(loss_type, eps=0.0, tau=0.05, delta=0.0, b=BETA):
    """Per-example expected losses, written out from the formulas with scalar math."""
    out = []
    sorted_margin = sorted(p - q for p, q in zip(PC, PR))
    sorted_ref_margin = sorted(p - q for p, q in zip(RC, RR))
    sc, sr = sorted(C), sorted(R)
    for i, (c, r) in enumerate(zip(C, R)):
        d = c - r
        if loss_type == "sigmoid":
            out.append(-logsig(b * d))
        elif loss_type == "hinge":
            out.append(max(0.0, 1 - b * d))
        elif loss_type == "ipo":
            out.append((c / LEN_C[i] - r / LEN_R[i] - 1 / (2 * b)) ** 2)
        elif loss_type == "sigmoid_norm":
            out.append(-logsig(b * (c / LEN_C[i] - r / LEN_R[i])))
        elif loss_type == "exo_pair":
            qw, ql = sig(b * d), sig(-b * d)
            out.append(qw * math.log(qw / (1 - eps)) + ql * math.log(ql / eps))
        elif loss_type == "nca_pair":
            out.append(-logsig(b * c) - 0.5 * logsig(-b * c) - 0.5 * logsig(-b * r))
        elif loss_type == "robust":
            out.append((-(1 - eps) * logsig(b * d) + eps * logsig(-b * d)) / (1 - 2 * eps))
        elif loss_type == "bco_pair":
            out.append(-logsig(b * c - delta) - logsig(-(b * r - delta)))
        elif loss_type == "sppo_hard":
            out.append((c - 1 / (2 * b)) ** 2 + (r + 1 / (2 * b)) ** 2)
        elif loss_type == "aot":
            x = sorted_margin[i] - sorted_ref_margin[i]
            out.append(-(1 - eps) * logsig(b * x) - eps * logsig(-b * x))
        elif loss_type == "aot_unpaired":
            x = sc[i] - sr[i]
            out.append(-(1 - eps) * logsig(b * x) - eps * logsig(-b * x))
        elif loss_type == "apo_zero":
            out.append((1 - sig(b * c)) + sig(b * r))
        elif loss_type == "apo_down":
            out.append(sig(b * c) + (1 - sig(b * (c - r))))
        elif loss_type == "discopop":
            w = sig(b * d / tau)
            out.append((1 - w) * -logsig(b * d) + w * math.exp(-b * d))
    return torch.tensor(out)


HAND_CASES = [
    ("sigmoid", {}),
    ("hinge", {}),
    ("ipo", {}),
    ("sigmoid_norm", {}),
    ("exo_pair", {"eps": 1e-3}),
    ("nca_pair", {}),
    ("robust", {"eps": 0.1}),
    ("robust", {"eps": 0.0}),
    ("bco_pair", {}),
    ("bco_pair", {"delta": 0.3}),
    ("sppo_hard", {}),
    ("aot", {}),
    ("aot", {"eps": 0.2}),
    ("aot_unpaired", {"eps": 0.2}),
    ("apo_zero", {}),
    ("apo_down", {}),
    ("discopop", {}),
    ("discopop", {"tau": 0.5}),
]


def call(loss_type, eps=0.0, tau=0.05, delta=0.0, requires_grad=False, **kwargs):
    return dpo_loss(
        loss_type, *inputs(requires_grad), beta=BETA, label_smoothing=eps, discopop_tau=tau, bco_delta=delta,
        chosen_lengths=torch.tensor(LEN_C), rejected_lengths=torch.tensor(LEN_R), **kwargs,
    )


@pytest.mark.parametrize(("loss_type", "params"), HAND_CASES)
def test_loss_matches_hand_computed(loss_type, params):
    got = call(loss_type, **params)
    assert got.shape == (3,)
    torch.testing.assert_close(got, expected(loss_type, **params), rtol=1e-5, atol=1e-6)


def test_hinge_is_zero_past_the_margin():
    loss = dpo_loss("hinge", torch.tensor([10.0]), torch.tensor([-10.0]), torch.zeros(1), torch.zeros(1), beta=1.0)
    assert loss.item() == 0.0


def test_sft_returns_the_given_nll():
    nll = torch.tensor(1.7)
    torch.testing.assert_close(call("sft", chosen_nll=nll), torch.full((3,), 1.7))
    per_example = torch.tensor([0.5, 1.0, 2.0])
    torch.testing.assert_close(call("sft", chosen_nll=per_example), per_example)


def test_f_divergence_scores_by_hand():
    x = torch.tensor(C)
    torch.testing.assert_close(f_divergence_scores(x, "reverse_kl"), x)
    torch.testing.assert_close(f_divergence_scores(x, "forward_kl"), torch.tensor([1 - math.exp(-v) for v in C]))
    js = [math.log(2 * math.exp(v) / (math.exp(v) + 1)) for v in C]
    torch.testing.assert_close(f_divergence_scores(x, "js_divergence"), torch.tensor(js))
    alpha = 0.5
    ad = [(math.exp(v) ** (alpha - 1) - 1) / (alpha - 1) for v in C]
    torch.testing.assert_close(f_divergence_scores(x, "alpha_divergence", alpha), torch.tensor(ad))
    torch.testing.assert_close(f_divergence_scores(x, "alpha_divergence", 1.0), x)


def test_sigmoid_with_js_divergence_by_hand():
    def js(v):
        return math.log(2) + logsig(v)

    want = torch.tensor([-logsig(BETA * (js(c) - js(r))) for c, r in zip(C, R)])
    torch.testing.assert_close(call("sigmoid", f_divergence_type="js_divergence"), want)


@pytest.mark.parametrize("loss_type", [t for t in DPO_LOSS_TYPES if t != "sft"])
def test_gradients_reach_policy_logps(loss_type):
    pc, pr, rc, rr = inputs(requires_grad=True)
    loss = dpo_loss(
        loss_type, pc, pr, rc, rr, beta=BETA, label_smoothing=1e-3 if loss_type == "exo_pair" else 0.0,
        chosen_lengths=torch.tensor(LEN_C), rejected_lengths=torch.tensor(LEN_R),
    )
    loss.mean().backward()
    grads = torch.cat([pc.grad, pr.grad])
    assert torch.isfinite(grads).all() and grads.abs().sum() > 0
    # The pairwise losses on d = s_c - s_r push chosen up and rejected down; DiscoPOP is not monotone in d
    # (its mixing weight switches near d = 0), and the others act on c and r separately or on sorted margins.
    if loss_type in ("sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust"):
        assert (pc.grad <= 0).all() and (pr.grad >= 0).all()


def test_sft_gradient_flows_through_nll():
    nll = torch.tensor(2.0, requires_grad=True)
    call("sft", chosen_nll=nll).mean().backward()
    assert nll.grad.item() == pytest.approx(1.0)


def test_implicit_rewards_and_metrics():
    pc, pr, rc, rr = inputs(requires_grad=True)
    chosen, rejected = implicit_rewards(pc, pr, rc, rr, beta=BETA)
    assert not chosen.requires_grad and not rejected.requires_grad
    torch.testing.assert_close(chosen, torch.tensor([BETA * v for v in C]))
    torch.testing.assert_close(rejected, torch.tensor([BETA * v for v in R]))
    metrics = reward_metrics(chosen, rejected)
    assert metrics["rewards/chosen"] == pytest.approx(BETA * sum(C) / 3)
    assert metrics["rewards/rejected"] == pytest.approx(BETA * sum(R) / 3)
    assert metrics["rewards/margins"] == pytest.approx(BETA * (sum(C) - sum(R)) / 3)
    assert metrics["rewards/accuracies"] == pytest.approx(2 / 3)  # pairs 0 and 1 rank chosen higher


def test_combined_loss_is_the_weighted_sum_of_means():
    weights = [0.8, 0.2, 1.0]
    nll = torch.tensor(1.5)
    total, parts = combined_dpo_loss(
        ["sigmoid", "bco_pair", "sft"], weights, *inputs(requires_grad=True), beta=BETA, chosen_nll=nll
    )
    sig_mean, bco_mean = expected("sigmoid").mean(), expected("bco_pair").mean()
    torch.testing.assert_close(total.detach(), 0.8 * sig_mean + 0.2 * bco_mean + 1.0 * 1.5)
    torch.testing.assert_close(parts["sigmoid"], sig_mean)
    torch.testing.assert_close(parts["bco_pair"], bco_mean)
    torch.testing.assert_close(parts["sft"], torch.tensor(1.5))
    assert total.requires_grad and not parts["sigmoid"].requires_grad
    unweighted, _ = combined_dpo_loss(["sigmoid", "hinge"], None, *inputs(), beta=BETA)
    torch.testing.assert_close(unweighted, expected("sigmoid").mean() + expected("hinge").mean())


def test_unknown_loss_type_lists_the_valid_ones():
    with pytest.raises(ValueError, match="sigmoid.*apo_zero"):
        call("dpo")
    with pytest.raises(ValueError, match="unknown DPO loss_type"):
        combined_dpo_loss(["sigmoid", "nope"], None, *inputs())


@pytest.mark.parametrize("eps", [0.5, 0.7, -0.1])
def test_robust_rejects_label_smoothing_outside_range(eps):
    with pytest.raises(ValueError, match=r"label_smoothing in \[0, 0.5\)"):
        call("robust", eps=eps)


def test_other_argument_errors():
    with pytest.raises(ValueError, match="one weight per loss type"):
        combined_dpo_loss(["sigmoid", "sft"], [1.0], *inputs(), chosen_nll=torch.tensor(1.0))
    with pytest.raises(ValueError, match="repeats"):
        combined_dpo_loss(["sigmoid", "sigmoid"], None, *inputs())
    with pytest.raises(ValueError, match="1e-3"):
        call("exo_pair", eps=0.0)
    with pytest.raises(ValueError, match="reverse_kl"):
        call("bco_pair", f_divergence_type="js_divergence")
    with pytest.raises(ValueError, match="f_divergence_type"):
        call("sigmoid", f_divergence_type="tv")
    with pytest.raises(ValueError, match="chosen_nll"):
        call("sft")
    with pytest.raises(ValueError, match="chosen_lengths"):
        dpo_loss("ipo", *inputs())
    with pytest.raises(ValueError, match=r"shape \(B,\)"):
        dpo_loss("sigmoid", torch.zeros(2), torch.zeros(3), torch.zeros(3), torch.zeros(3))


# ---------------------------------------------------------------------------------------------------------------
# Parity with TRL: `DPOTrainer._compute_loss` runs on a stub trainer whose stub model returns fixed per-token
# log-probs, with the reference log-probs passed as precomputed inputs.


def _trl_loss(loss_types, loss_weights, per_token_logps, completion_mask, ref_chosen, ref_rejected,
              ld_alpha=None, log_sum_sq=None, **cfg):
    from trl.trainer.dpo_trainer import DPOTrainer

    n = per_token_logps.shape[0]
    model = SimpleNamespace(training=True)

    def forward(**_kwargs):
        zeros = torch.zeros_like(per_token_logps)
        return SimpleNamespace(log_probs=per_token_logps, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool(),
                               log_sum_sq_probs=log_sum_sq)

    trainer = SimpleNamespace(
        model=model,
        accelerator=SimpleNamespace(device=torch.device("cpu"), gather=lambda x: x, gather_for_metrics=lambda x: x),
        aux_loss_enabled=False, ld_alpha=ld_alpha, precompute_ref_logps=True, use_weighting=log_sum_sq is not None,
        beta=cfg.get("beta", 0.1), label_smoothing=cfg.get("label_smoothing", 0.0),
        f_divergence_type=cfg.get("f_divergence_type", "reverse_kl"),
        f_alpha_divergence_coef=cfg.get("f_alpha_divergence_coef", 0.5),
        loss_types=loss_types, loss_weights=loss_weights or [1.0] * len(loss_types),
        args=SimpleNamespace(discopop_tau=cfg.get("discopop_tau", 0.05)),
        _metrics=defaultdict(lambda: defaultdict(list)), _total_train_tokens=0, _tp_size=1,
    )
    batch = {
        "input_ids": torch.zeros_like(completion_mask, dtype=torch.long),
        "attention_mask": torch.ones_like(completion_mask),
        "completion_mask": completion_mask,
        "ref_chosen_logps": ref_chosen,
        "ref_rejected_logps": ref_rejected,
    }
    loss = DPOTrainer._compute_loss(trainer, forward, batch, False)
    assert n == 2 * ref_chosen.shape[0]
    return loss, trainer._metrics["train"]


def _random_batch(seed=0, batch_size=4, seq_len=7):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, seq_len, (2 * batch_size,), generator=gen)
    positions = torch.arange(seq_len)
    completion_mask = ((positions >= 1) & (positions <= lengths[:, None])).long()  # position 0 is the prompt
    shift_mask = completion_mask[:, 1:]
    per_token = -torch.rand(2 * batch_size, seq_len - 1, generator=gen) * shift_mask
    ref_logps = (-torch.rand(2 * batch_size, seq_len - 1, generator=gen) * shift_mask).sum(1)
    return per_token, completion_mask, ref_logps[:batch_size], ref_logps[batch_size:]


PARITY_CASES = [(t, {}) for t in DPO_LOSS_TYPES if t != "exo_pair"] + [
    ("exo_pair", {"label_smoothing": 1e-3}),
    ("robust", {"label_smoothing": 0.2}),
    ("aot", {"label_smoothing": 0.1}),
    ("aot_unpaired", {"label_smoothing": 0.1}),
    ("discopop", {"discopop_tau": 0.3}),
] + [
    (t, {"f_divergence_type": f, "f_alpha_divergence_coef": 0.3})
    for t in F_DIVERGENCE_LOSS_TYPES
    if t not in ("sft", "exo_pair")
    for f in ("forward_kl", "js_divergence", "alpha_divergence")
]


@pytest.mark.parametrize(("loss_type", "cfg"), PARITY_CASES)
def test_parity_with_trl(loss_type, cfg):
    pytest.importorskip("trl")
    cfg = {"beta": 0.3, "label_smoothing": cfg.pop("label_smoothing", 0.0), **cfg}
    per_token, completion_mask, ref_chosen, ref_rejected = _random_batch(seed=len(loss_type))
    trl_loss, metrics = _trl_loss([loss_type], None, per_token, completion_mask, ref_chosen, ref_rejected, **cfg)

    b = ref_chosen.shape[0]
    shift_mask = completion_mask[:, 1:].bool()
    logps = per_token.sum(1)
    lengths = completion_mask.sum(1).float()
    chosen_nll = -per_token[:b][shift_mask[:b]].mean()
    ours = dpo_loss(
        loss_type, logps[:b], logps[b:], ref_chosen, ref_rejected, chosen_nll=chosen_nll,
        chosen_lengths=lengths[:b], rejected_lengths=lengths[b:], **cfg,
    )
    torch.testing.assert_close(ours.mean(), trl_loss, rtol=1e-5, atol=1e-6)

    ours_metrics = reward_metrics(*implicit_rewards(logps[:b], logps[b:], ref_chosen, ref_rejected, cfg["beta"]))
    for key, value in ours_metrics.items():
        assert metrics[key][-1] == pytest.approx(value, rel=1e-5, abs=1e-6)


def test_parity_with_trl_combined():
    pytest.importorskip("trl")
    per_token, completion_mask, ref_chosen, ref_rejected = _random_batch(seed=3)
    types, weights = ["sigmoid", "bco_pair", "sft"], [0.8, 0.2, 1.0]
    trl_loss, _ = _trl_loss(types, weights, per_token, completion_mask, ref_chosen, ref_rejected, beta=0.2)
    b = ref_chosen.shape[0]
    logps = per_token.sum(1)
    chosen_nll = -per_token[:b][completion_mask[:b, 1:].bool()].mean()
    total, _ = combined_dpo_loss(
        types, weights, logps[:b], logps[b:], ref_chosen, ref_rejected, beta=0.2, chosen_nll=chosen_nll
    )
    torch.testing.assert_close(total, trl_loss, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("ld_alpha,wpo", [(0.5, False), (None, True), (0.3, True)])
def test_ld_dpo_and_wpo_match_trl(ld_alpha, wpo):
    """LD-DPO's length-desensitised log-probs and WPO's pair weights, against TRL's `_compute_loss`."""
    pytest.importorskip("trl")
    from hf_verl.algorithms.dpo_losses import ld_token_weights, wpo_weights

    per_token, completion_mask, ref_chosen, ref_rejected = _random_batch(seed=11)
    shift = completion_mask[:, 1:].bool()
    log_sum_sq = (-torch.rand(per_token.shape, generator=torch.Generator().manual_seed(5)) * 3) if wpo else None
    # TRL's WPO multiplies the sft term's expanded loss in place, which fails; LD-DPO is tested with it
    types = ["sigmoid", "hinge"] if wpo else ["sigmoid", "sft"]
    trl_loss, _ = _trl_loss(types, None, per_token, completion_mask, ref_chosen, ref_rejected,
                            ld_alpha=ld_alpha, log_sum_sq=log_sum_sq, beta=0.2)
    n, b = per_token.shape[0], ref_chosen.shape[0]
    owner = torch.arange(n).unsqueeze(1).expand_as(shift)[shift]
    tokens = per_token[shift]
    weighted = tokens * ld_token_weights(owner, n, ld_alpha) if ld_alpha is not None else tokens
    logps = torch.zeros(n).index_add(0, owner, weighted)
    weights = wpo_weights(tokens, log_sum_sq[shift], owner, n) if wpo else None
    chosen_nll = -per_token[:b][shift[:b]].mean()
    total, _ = combined_dpo_loss(types, None, logps[:b], logps[b:], ref_chosen, ref_rejected,
                                 pair_weights=weights, beta=0.2, chosen_nll=chosen_nll)
    torch.testing.assert_close(total, trl_loss, rtol=1e-5, atol=1e-6)
    assert ld_token_weights(torch.tensor([0, 0, 0, 1]), 2, 0.5).tolist() == [1.0, 0.5, 0.5, 1.0]
