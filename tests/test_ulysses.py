"""Ulysses sequence parallelism (hf_verl.parallel.ulysses).

Single process: head checks and their messages, the registered attention without a shard is
transformers' sdpa, the guards. Two processes (torchrun, gloo, `tests/distributed/ulysses_parity.py`):
sp=2 against one process on the same packed batch (35 real tokens, padded to 36; rows straddle the
shard boundary; one multi-turn row) for Llama and Qwen2 with GQA (4 query / 2 KV heads), Qwen2 with
sp=2 > 1 KV head (replicated), Llama with 1 KV head under gradient checkpointing, and Llama with 6 query /
3 KV heads (sp=2 divides neither KV count nor is a multiple: each KV head sent twice): logits, token
log-probs, entropy, critic values and every parameter gradient (actor and critic) within 1e-5, fp32.
Measured: logits 0, log-probs <= 7e-7, entropy <= 5e-7, values <= 5e-8, gradients <= 2.4e-6 (largest
gradient about 20).
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_verl.data.packing import pack_rows
from hf_verl.parallel import ulysses
from hf_verl.parallel.dims import ParallelDims

ROOT = Path(__file__).resolve().parents[1]
CASES = ("llama_gqa", "qwen2_gqa", "qwen2_kv1", "llama_kv1_checkpointed", "llama_h6_kv3")


# ---------------------------------------------------------------------- heads
@pytest.mark.parametrize("heads, kv_heads, sp, repeats", [
    (4, 2, 2, 1), (4, 4, 4, 1), (8, 2, 2, 1), (4, 1, 2, 2), (8, 2, 4, 2), (4, 1, 4, 4), (7, 7, 1, 1),
    (6, 3, 2, 2), (14, 2, 7, 7), (28, 4, 14, 7), (32, 8, 16, 2)])
def test_kv_heads_are_split_or_replicated(heads, kv_heads, sp, repeats):
    assert ulysses.kv_head_repeats(heads, kv_heads, sp) == repeats
    # every rank's replicated KV heads are exactly those of its query heads
    group, kv_per_rank, q_per_rank = heads // kv_heads, kv_heads * repeats // sp, heads // sp
    for rank in range(sp):
        kv_of_rank = [j // repeats for j in range(rank * kv_per_rank, (rank + 1) * kv_per_rank)]
        local_group = q_per_rank // kv_per_rank
        for j in range(q_per_rank):
            assert kv_of_rank[j // local_group] == (rank * q_per_rank + j) // group


def test_degrees_that_do_not_divide_the_query_heads_are_refused_naming_the_numbers():
    with pytest.raises(ValueError, match=r"model has 3 query heads, which 2 does not divide; choose "
                                         r"sequence_parallel_size in \[1, 3\]"):
        ulysses.kv_head_repeats(3, 1, 2)
    with pytest.raises(ValueError, match=r"model has 4 query heads, which 8 does not divide"):
        ulysses.kv_head_repeats(4, 2, 8)  # more ranks than query heads
    with pytest.raises(ValueError, match="6 query heads cannot be grouped over 4 key/value heads"):
        ulysses.kv_head_repeats(6, 4, 2)


def test_apply_checks_the_config_up_front():
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config

    model = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=48, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=3, num_key_value_heads=1, attn_implementation="sdpa"))
    assert ulysses.apply_sequence_parallel(model, ParallelDims()) is model  # sp=1: untouched
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="3 query heads, which 2 does not divide"):
        ulysses.apply_sequence_parallel(model, ParallelDims(sp=2, world_size=2))
    assert model.config._attn_implementation == "sdpa"
    sliding = Qwen2Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                          max_window_layers=0, num_hidden_layers=2)
    with pytest.raises(ValueError, match="sliding-window attention"):
        ulysses.check_model(sliding, 2)
    assert ulysses.check_model(Qwen2Config(num_attention_heads=4, num_key_value_heads=1, hidden_size=32), 2) == 2


# ---------------------------------------------------------------------- one process
def _llama(attention="sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=30, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
                                        attn_implementation=attention)).eval()


def test_without_a_shard_the_attention_is_transformers_sdpa():
    """The same model still runs padded batches and generates once switched to the Ulysses attention."""
    ref, model = _llama(), _llama(ulysses.ATTENTION)
    ids = torch.tensor([[0, 0, 3, 4, 5], [6, 7, 8, 9, 10]])
    mask = (ids != 0).long()
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask).logits
        assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, want)
    kwargs = {"attention_mask": mask, "max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(model.generate(ids, **kwargs), ref.generate(ids, **kwargs))


def test_a_shard_is_refused_when_the_model_does_not_run_the_ulysses_attention():
    model = _llama()  # plain sdpa: each rank would attend to its own shard only
    packed = pack_rows([[1, 2, 3]], [[4, 5, 6]], multiple_of=2)
    shard = ulysses.SequenceShard(packed=packed, group=None, size=2, rank=0)
    with pytest.raises(ValueError, match=r"did not run the 'hf_verl_ulysses' attention.*apply_sequence_parallel"):
        ulysses.shard_token_stats(model, model.get_output_embeddings(), shard)


def test_a_packed_length_that_does_not_split_evenly_is_refused():
    packed = pack_rows([[1, 2, 3]], [[4, 5]])  # 5 tokens
    with pytest.raises(ValueError, match="5 tokens, not a multiple of the sequence-parallel degree 2; pack it "
                                         "with multiple_of=2"):
        ulysses.shard_sequence(packed, ParallelDims(sp=2, world_size=2))
    shard = ulysses.shard_sequence(packed, ParallelDims())
    x = torch.randn(1, 5)
    assert ulysses.gather_sequence(x, shard) is x and torch.equal(shard.input_ids, packed.input_ids)


# ---------------------------------------------------------------------- two processes
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def sp2(tmp_path_factory):
    out = tmp_path_factory.mktemp("ulysses")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
           "-m", "tests.distributed.ulysses_parity", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads((out / f"rank{k}.json").read_text()) for k in (0, 1)]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_sp2_equals_one_process(sp2, case):
    for rank, result in enumerate(sp2):
        assert (result["world"], result["sp_rank"], result["group_rank"]) == (2, rank, rank)
        got = result["cases"][case]
        # the sharded forward really ran the Ulysses attention, once per layer
        assert got["attention"] == ulysses.ATTENTION and got["attention_calls"] == 2
        # an odd number of real tokens, padded by one; a row straddles the shard boundary and its label there
        # is the next shard's first token
        assert (got["real_tokens"], got["length"], got["shard_length"]) == (35, 36, 18)
        assert got["boundary_same_row"] and got["boundary_label"] == got["next_shard_first"]
        for key in ("logits", "logp", "entropy", "values"):
            assert got[f"max_diff_{key}"] < 1e-5, (key, got[f"max_diff_{key}"])
            assert got[f"max_abs_{key}"] > 0.1  # not a vacuous comparison
        assert got["max_diff_grad"] < 1e-5 and got["max_abs_grad"] > 1.0
        assert got["params_with_gradient"] == got["params"]  # every parameter, actor and critic, compared


@pytest.mark.multiprocess
@pytest.mark.slow
def test_sp2_refuses_heads_it_cannot_split(sp2):
    for result in sp2:
        assert "model has 3 query heads, which 2 does not divide" in result["refused"]["heads3"]


def test_the_shard_passes_through_wrappers_that_rebuild_dataclass_inputs():
    """FSDP2 casts a forward's floating inputs under mixed precision by rebuilding dataclasses among them; the
    shard must arrive as the very object (its attention-call count and mask cache live on it)."""
    from torch.distributed.utils import (
        _apply_to_tensors,  # the function FSDP2's input casting uses
    )

    shard = ulysses.SequenceShard(pack_rows([[1, 2]], [[3, 4]]), group=None, size=1, rank=0)
    kwargs = _apply_to_tensors(lambda t: t.clone(), {"sequence_shard": shard, "x": torch.ones(1)})
    assert kwargs["sequence_shard"] is shard
