"""RepeatGroupSampler: round layout across repeats and processes."""

import pytest

from hf_verl.data.samplers import RepeatGroupSampler


def _batches(sampler, size):
    idx = list(sampler)
    return [idx[i : i + size] for i in range(0, len(idx), size)]


def test_groups_repeat_and_split_across_processes():
    s = RepeatGroupSampler(num_prompts=5, num_generations=2, chunk_size=2, world_size=2, repeat=3, shuffle=False)
    assert s.prompts_per_round == 2 and s.num_rounds == 2  # prompt 4 is dropped (partial round)
    batches = _batches(s, 2)
    assert len(s) == len(batches) * 2 == 2 * 3 * 2 * 2
    # round 0: process 0 gets prompt 0's group, process 1 prompt 1's, each 3 times in a row
    rank0, rank1 = batches[0::2], batches[1::2]
    assert rank0[:3] == [[0, 0]] * 3 and rank1[:3] == [[1, 1]] * 3
    assert rank0[3:] == [[2, 2]] * 3 and rank1[3:] == [[3, 3]] * 3


def test_a_group_may_span_processes():
    s = RepeatGroupSampler(num_prompts=2, num_generations=4, chunk_size=2, world_size=2, shuffle=False)
    assert _batches(s, 2) == [[0, 0], [0, 0], [1, 1], [1, 1]]


def test_shuffle_follows_set_epoch():
    s = RepeatGroupSampler(num_prompts=50, num_generations=2, chunk_size=4, shuffle=True, seed=3)
    s.set_epoch(1)
    a = list(s)
    s.set_epoch(1)
    assert list(s) == a
    s.set_epoch(2)
    assert list(s) != a
    assert sorted(set(a)) == list(range(50))


def test_bad_layouts_say_what_to_change():
    with pytest.raises(ValueError, match="does not hold whole groups of num_generations=4"):
        RepeatGroupSampler(num_prompts=8, num_generations=4, chunk_size=3, world_size=2)
    with pytest.raises(ValueError, match="has 1 prompts but one generation round needs 2"):
        RepeatGroupSampler(num_prompts=1, num_generations=2, chunk_size=4)
