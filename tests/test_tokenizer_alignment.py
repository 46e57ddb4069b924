"""A reference on another tokenizer: the same-tokenizer test, the offset alignment rule, the facade end to end."""

import pytest
import torch

from hf_verl.algorithms.kl import kl_penalty
from hf_verl.algorithms.token_alignment import align_logprobs
from hf_verl.pipeline.cross_tokenizer import CrossTokenizer, retokenize, same_tokenizer, token_ends
from tests.conftest import build_bpe_tokenizer, build_char_tokenizer


# ---------------------------------------------------------------------- the rule, on hand-worked examples
def test_equal_tokenisations_copy_the_log_probs():
    aligned, assigned = align_logprobs([1, 3, 4], [1, 3, 4], torch.tensor([-1.0, -2.0, -3.0]))
    assert aligned.tolist() == [-1.0, -2.0, -3.0] and assigned.all()


def test_a_coarser_actor_token_gets_the_sum_of_its_role_tokens():
    # actor "ab" "c", role "a" "b" "c"
    aligned, assigned = align_logprobs([2, 3], [1, 2, 3], torch.tensor([-1.0, -2.0, -3.0]))
    assert aligned.tolist() == [-3.0, -3.0] and assigned.tolist() == [True, True]


def test_a_finer_actor_gives_the_role_token_to_the_last_of_its_pieces():
    # actor "a" "b" "c", role "ab" "c"
    aligned, assigned = align_logprobs([1, 2, 3], [2, 3], torch.tensor([-5.0, -1.0]))
    assert aligned.tolist() == [0.0, -5.0, -1.0] and assigned.tolist() == [False, True, True]
    actor = torch.tensor([-0.5, -0.75, -0.25])
    aligned, _ = align_logprobs([1, 2, 3], [2, 3], torch.tensor([-5.0, -1.0]), actor)
    assert aligned.tolist() == [-0.5, -4.5, -1.0]  # the segment "ab" sums to the role's -5


def test_crossing_boundaries_make_one_segment():
    # actor "ab" "c", role "a" "bc": the only common boundary is the end
    aligned, assigned = align_logprobs([2, 3], [1, 3], torch.tensor([-1.0, -2.0]))
    assert aligned.tolist() == [0.0, -3.0] and assigned.tolist() == [False, True]
    aligned, _ = align_logprobs([2, 3], [1, 3], torch.tensor([-1.0, -2.0]), torch.tensor([-0.5, -0.25]))
    assert aligned.tolist() == [-0.5, -2.5]


def test_an_eos_that_adds_no_text_keeps_the_actor_log_prob_and_the_segment_sum():
    # actor "a" "b" <eos>, role "a" "b" <eos> (ends 1, 2, 2)
    aligned, _ = align_logprobs([1, 2, 2], [1, 2, 2], torch.tensor([-1.0, -2.0, -0.5]),
                                torch.tensor([-1.5, -2.5, -0.25]))
    assert aligned.tolist() == pytest.approx([-1.0, -2.25, -0.25])
    assert aligned.sum().item() == pytest.approx(-3.5)  # the role's whole log-prob


def test_bad_inputs_say_what_is_wrong():
    with pytest.raises(ValueError, match="role_logprobs has shape"):
        align_logprobs([1, 2], [1, 2], torch.zeros(3))
    with pytest.raises(ValueError, match="actor_ends must be non-decreasing"):
        align_logprobs([2, 1], [1, 2], torch.zeros(2))


# ---------------------------------------------------------------------- tokenizers built in code
def test_same_tokenizer_is_decided_from_the_vocabulary_not_the_size():
    char, bpe = build_char_tokenizer(), build_bpe_tokenizer()
    assert same_tokenizer(char, build_char_tokenizer())
    assert same_tokenizer(char, build_char_tokenizer(pad=False))  # padding is not part of the meaning of ids
    assert not same_tokenizer(char, bpe)
    # same size, other ids: two letters swapped
    vocab = char.get_vocab()
    swapped = build_char_tokenizer()
    backend = swapped.backend_tokenizer
    import json

    data = json.loads(backend.to_str())
    data["model"]["vocab"]["a"], data["model"]["vocab"]["b"] = vocab["b"], vocab["a"]
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    other = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(data)), eos_token="<eos>",
                                    pad_token="<pad>")
    other.add_special_tokens({"additional_special_tokens": ["<user>", "<assistant>", "<system>"]})
    assert len(other) == len(char) and not same_tokenizer(char, other)


def test_token_ends_and_retokenisation_with_offsets():
    char, bpe = build_char_tokenizer(), build_bpe_tokenizer()
    prompt, completion = char("the ")["input_ids"], char("answer is")["input_ids"] + [char.eos_token_id]
    p_text, c_text, ends = token_ends(char, prompt, completion)
    assert (p_text, c_text) == ("the ", "answer is")
    assert ends == [1, 2, 3, 4, 5, 6, 7, 8, 9, 9]  # the EOS adds no text
    rp, rc, r_ends = retokenize(bpe, p_text, c_text, append_eos=True)
    assert bpe.decode(rp) == "the " or bpe.decode(rp + rc[:1]).startswith("the ")
    assert bpe.decode(rp + rc[:-1]) == "the answer is" and rc[-1] == bpe.eos_token_id
    assert r_ends[-2] == r_ends[-1] == len(c_text) and r_ends == sorted(r_ends)
    assert len(rc) < len(completion)  # BPE merges: fewer, longer tokens


@pytest.mark.parametrize("actor_kind", ["char", "bpe"])
def test_kl_is_zero_when_the_role_factorises_the_actor_over_its_own_tokens(actor_kind):
    """A role whose token log-prob is exactly the actor's summed log-prob of the same characters (the same
    distribution over text, cut into other tokens): aligned with the actor's log-probs, every token's KL is 0."""
    char, bpe = build_char_tokenizer(), build_bpe_tokenizer()
    actor_tok, role_tok = (char, bpe) if actor_kind == "char" else (bpe, char)
    prompt, completion = actor_tok("hello ")["input_ids"], actor_tok("world, how are you")["input_ids"]
    p_text, c_text, a_ends = token_ends(actor_tok, prompt, completion)
    _, _, r_ends = retokenize(role_tok, p_text, c_text, append_eos=False)
    torch.manual_seed(0)
    actor_lp = -torch.rand(len(completion), dtype=torch.float64)
    # per character: the actor token's log-prob spread evenly over its characters, summed again per role token
    starts = [0] + a_ends[:-1]
    per_char = torch.zeros(len(c_text), dtype=torch.float64)
    for lp, s, e in zip(actor_lp, starts, a_ends):
        per_char[s:e] = lp / (e - s)
    r_starts = [0] + r_ends[:-1]
    role_lp = torch.stack([per_char[max(s, 0):e].sum() for s, e in zip(r_starts, r_ends)])
    aligned, _ = align_logprobs(a_ends, r_ends, role_lp.float(), actor_lp.float())
    assert aligned.sum().item() == pytest.approx(actor_lp.sum().item(), abs=1e-5)
    # every BPE boundary is a character boundary, so each segment is one token of the coarser tokenisation and
    # the rule gives back the actor's own log-probs: a KL of exactly 0 on every token (k1, k2, k3)
    assert torch.allclose(aligned, actor_lp.float(), atol=1e-5)
    for estimator in ("k1", "k2", "k3"):
        assert kl_penalty(actor_lp.float(), aligned, estimator).abs().max().item() < 1e-5


# ---------------------------------------------------------------------- the facade, end to end
def test_facade_reference_on_another_tokenizer(tmp_path):
    from hf_verl import Trainer
    from tests.test_facade import count_a, tiny_llama

    char, bpe = build_char_tokenizer(), build_bpe_tokenizer()
    actor, reference = tiny_llama(char, seed=0), tiny_llama(bpe, seed=1)
    assert len(char) != len(bpe)
    config = dict(group_size=2, max_new_tokens=5, seed=0, use_async_rollout=False, beta=0.1,
                  per_row_sampling_seed=True)
    trainer = Trainer(actor_model=actor, reference_model=reference, reward_model=count_a, tokenizer=char,
                      reference_tokenizer=bpe, config=config)
    out = trainer.rollout(["the ", "hello "])
    assert out.ref_logprobs.shape == out.completion_mask.shape and torch.isfinite(out.ref_logprobs).all()
    # the same numbers by hand: re-tokenise, run the reference, align with the actor's log-probs
    cross = CrossTokenizer(char, bpe)
    role_batch, a_ends, r_ends = cross.role_batch(out)
    with torch.no_grad():
        ids = role_batch.input_ids
        logits = reference(input_ids=ids, attention_mask=role_batch.attention_mask).logits.float()
        width = role_batch.completion_ids.shape[1]
        role_lp = torch.log_softmax(logits[:, -width - 1 : -1], -1).gather(
            -1, role_batch.completion_ids.unsqueeze(-1)).squeeze(-1)
        a_logits = actor(input_ids=out.input_ids, attention_mask=out.attention_mask).logits.float()
        c = out.completion_ids.shape[1]
        actor_lp = torch.log_softmax(a_logits[:, -c - 1 : -1], -1).gather(
            -1, out.completion_ids.unsqueeze(-1)).squeeze(-1)
    expected = cross.align(role_lp, r_ends, a_ends, actor_lp, out.completion_mask)
    assert torch.allclose(out.ref_logprobs, expected, atol=1e-4)
    metrics = trainer.step(trainer.compute_loss(out))
    assert torch.isfinite(torch.tensor(metrics["kl"]))


def test_a_reference_object_of_another_size_without_its_tokenizer_is_refused_with_the_fix():
    from hf_verl import Trainer
    from tests.test_facade import count_a, tiny_llama

    char, bpe = build_char_tokenizer(), build_bpe_tokenizer()
    with pytest.raises(ValueError, match="pass reference_tokenizer="):
        Trainer(actor_model=tiny_llama(char), reference_model=tiny_llama(bpe), reward_model=count_a, tokenizer=char)
