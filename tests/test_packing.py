"""Padding-free packing of RL rows (hf_verl.data.packing): layout, labels, padding, and the packed forward
equal to the padded one on a tiny Llama (fp32, within 1e-5; measured: logits 6e-8, log-probs 2.4e-7,
with sdpa, eager and the Ulysses attention alike)."""

import pytest
import torch

from hf_verl.data.batch import RolloutBatch
from hf_verl.data.packing import (
    block_causal_mask,
    pack_padded,
    pack_rollout,
    pack_rows,
    unpack_completion,
)

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
COMPLETIONS = [[14, 15], [16, 17, 18, 19], [20]]


def test_rows_are_concatenated_with_restarting_positions_and_boundaries():
    packed = pack_rows(PROMPTS, COMPLETIONS)
    assert packed.input_ids.tolist() == [[5, 6, 7, 14, 15, 8, 9, 16, 17, 18, 19, 10, 11, 12, 13, 20]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4]]
    assert packed.cu_seqlens.tolist() == [0, 5, 11, 16] and packed.cu_seqlens.dtype == torch.int32
    assert packed.segment_ids.tolist() == [0] * 5 + [1] * 6 + [2] * 5
    assert (packed.num_rows, packed.num_tokens, packed.length, packed.max_seqlen) == (3, 16, 16, 6)


def test_labels_are_the_next_token_of_the_same_row_never_the_next_rows():
    packed = pack_rows(PROMPTS, COMPLETIONS)
    ids, labels, seg = packed.input_ids[0], packed.labels[0], packed.segment_ids
    for i in range(packed.length):
        if i + 1 < packed.length and seg[i + 1] == seg[i]:
            assert labels[i] == ids[i + 1]
        else:  # a row's last token has no label, and is never scored
            assert labels[i] == 0 and not packed.loss_mask[0, i]
    # scored: the positions predicting completion tokens (the last prompt token predicts the first)
    assert packed.loss_mask[0].nonzero().flatten().tolist() == [2, 3, 6, 7, 8, 9, 14]


def test_unpack_puts_each_position_back_under_the_completion_token_it_predicts():
    batch = RolloutBatch.from_lists(PROMPTS, COMPLETIONS, pad_token_id=0)
    packed = pack_rollout(batch, multiple_of=4)
    # the label at the position predicting a completion token is that token: a round trip
    assert torch.equal(unpack_completion(packed, packed.labels), batch.completion_ids * batch.completion_mask)
    values = torch.arange(packed.length, dtype=torch.float32).requires_grad_()
    out = packed.unpack(values)
    assert out.tolist() == [[2, 3, 0, 0], [6, 7, 8, 9], [14, 0, 0, 0]]
    out.sum().backward()  # autograd flows to the scored positions only
    assert values.grad.nonzero().flatten().tolist() == [2, 3, 6, 7, 8, 9, 14]
    # trailing feature dimensions ride along: (1, T, V) logits -> (B, C, V)
    logits = torch.randn(1, packed.length, 5)
    assert torch.equal(packed.unpack(logits)[1, 2], logits[0, 8]) and not packed.unpack(logits)[0, 2].any()
    with pytest.raises(ValueError, match="values have 3 positions, the packed sequence has 16"):
        packed.unpack(torch.zeros(3))


@pytest.mark.parametrize("multiple", [1, 2, 3, 4, 5, 7])
def test_padding_to_a_multiple_is_a_segment_of_its_own_at_the_end(multiple):
    packed = pack_rows(PROMPTS, COMPLETIONS, multiple_of=multiple, pad_token_id=1)
    tail = -16 % multiple
    assert packed.length == 16 + tail and packed.length % multiple == 0 and packed.num_tokens == 16
    assert packed.input_ids[0, 16:].tolist() == [1] * tail
    assert packed.position_ids[0, 16:].tolist() == list(range(tail))
    assert packed.segment_ids[16:].tolist() == [3] * tail
    assert not packed.labels[0, 15:].any() and not packed.loss_mask[0, 15:].any()
    assert packed.cu_seqlens.tolist() == [0, 5, 11, 16] + ([16 + tail] if tail else [])


def test_an_odd_length_is_padded_for_sp_2():
    packed = pack_rows([[1, 2], [3]], [[4, 5], [6, 7]], multiple_of=2)
    assert (packed.num_tokens, packed.length) == (7, 8)


def test_attended_but_unscored_tokens_stay_in_context_and_masked_tokens_are_dropped():
    # row 0: completion tokens 21, 22 are a tool observation (attended, not scored); row 1: right padding
    p_ids = torch.tensor([[0, 5, 6], [7, 8, 9]])
    p_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    c_ids = torch.tensor([[20, 21, 22, 23], [24, 25, 0, 0]])
    c_attn = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    c_mask = torch.tensor([[1, 0, 0, 1], [1, 1, 0, 0]])
    packed = pack_padded(p_ids, p_mask, c_ids, c_mask, completion_attention_mask=c_attn)
    assert packed.input_ids.tolist() == [[5, 6, 20, 21, 22, 23, 7, 8, 9, 24, 25]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4]]
    assert packed.loss_mask[0].nonzero().flatten().tolist() == [1, 4, 8, 9]
    assert packed.unpack(packed.labels).tolist() == [[20, 0, 0, 23], [24, 25, 0, 0]]


def test_block_causal_mask_never_crosses_rows():
    packed = pack_rows([[1, 2], [3]], [[4], [5, 6]], multiple_of=4)  # segments 0 0 0 | 1 1 1 | tail 2 2
    mask = block_causal_mask(packed.segment_ids)[0, 0]
    assert mask.shape == (8, 8)
    for q in range(8):
        for k in range(8):
            assert bool(mask[q, k]) == (k <= q and int(packed.segment_ids[q]) == int(packed.segment_ids[k]))


def test_unscoreable_rows_are_refused():
    with pytest.raises(ValueError, match="row 1 scores its first token"):
        pack_rows([[1], []], [[2], [3, 4]])
    with pytest.raises(ValueError, match="row 0 scores a completion token its completion_attention_mask does not"):
        pack_padded(torch.tensor([[1]]), torch.tensor([[1]]), torch.tensor([[2, 3]]), torch.tensor([[1, 1]]),
                    completion_attention_mask=torch.tensor([[1, 0]]))
    with pytest.raises(ValueError, match="multiple_of must be >= 1"):
        pack_rows(PROMPTS, COMPLETIONS, multiple_of=0)


def test_loss_masks_and_empty_rows():
    packed = pack_rows([[1, 2], [], [3]], [[4, 5, 6], [], [7]], loss_masks=[[1, 0, 1], [], [0]], multiple_of=2)
    assert packed.cu_seqlens.tolist() == [0, 5, 5, 7, 8]  # the empty row is an empty segment
    assert packed.unpack(packed.labels).tolist() == [[4, 0, 6], [0, 0, 0], [0, 0, 0]]
    empty = pack_rows([[]], [[]], multiple_of=2)
    assert empty.length == 2 and not empty.loss_mask.any() and empty.unpack(empty.labels).shape == (1, 0)


# ---------------------------------------------------------------------- packed forward == padded forward
def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    return LlamaForCausalLM(config).float().eval()


def _rollout():
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 40, (n,), generator=g).tolist() for n in (3, 6, 1, 4)]
    completions = [torch.randint(1, 40, (n,), generator=g).tolist() for n in (5, 2, 7, 3)]
    return RolloutBatch.from_lists(prompts, completions, pad_token_id=0)


@pytest.mark.parametrize("attention", ["sdpa", "eager", "hf_verl_ulysses"])
def test_packed_logits_and_logprobs_equal_the_padded_forward(attention):
    from hf_verl.engine.hf_layouts import position_ids_from_mask, rollout_positions
    from hf_verl.parallel.dims import ParallelDims
    from hf_verl.parallel.ulysses import packed_logprobs, shard_sequence

    model = _tiny_llama()
    model.set_attn_implementation(attention)
    batch = _rollout()
    input_ids, mask, select, targets = rollout_positions(batch)
    with torch.no_grad():
        padded = model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
        want_logp = torch.log_softmax(padded, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        want = torch.zeros(batch.completion_mask.shape).masked_scatter(batch.completion_mask.bool(), want_logp[select])
        packed = pack_rollout(batch, multiple_of=4)
        assert packed.length == 32 and packed.num_tokens == 31
        logits = model(**shard_sequence(packed, ParallelDims()).model_inputs()).logits
        got, entropy = packed_logprobs(model, model.get_output_embeddings(), packed, ParallelDims(), chunk_size=5,
                                       with_entropy=True)
    # logits at every real token: the padded forward's, row by row
    real = mask.bool()
    assert (logits[0, : packed.num_tokens] - padded[real]).abs().max() < 1e-5
    assert (got - want).abs().max() < 1e-5 and want.abs().max() > 1.0
    assert torch.equal(got == 0, ~batch.completion_mask.bool()) and (entropy[batch.completion_mask.bool()] > 0).all()
