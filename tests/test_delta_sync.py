"""Delta weight sync (hf_verl.parallel.weight_delta, `weight_sync="auto" | "full" | "delta"`): per tensor nothing, a
sparse delta or the whole tensor, at the receiver's dtype, and exact after apply.

The encoding is checked on tensors against a hand-made change; `hf-verl serve` (bf16 weights) behind the remote engine
is then trained against with GRPO: every sync after the first moves far fewer bytes than a full one, and the served
weights equal the trained policy cast to bf16, bit for bit. A malformed delta is refused with the weights unchanged.
"""

import json
import urllib.request

import pytest
import torch

from hf_verl.parallel.weight_delta import (
    DELTA_INDEX,
    DELTA_VALUE,
    DeltaTracker,
    apply_sparse,
    encode_tensor,
    split_entries,
)
from hf_verl.rollout.hf_engine import TransformersEngine
from hf_verl.serve.server import RolloutServer
from tests.conftest import build_char_tokenizer

TOKEN = "s3cret"


def test_a_tensor_is_skipped_sent_sparse_or_whole_and_applies_exactly():
    torch.manual_seed(0)
    last = torch.randn(64, 32).to(torch.bfloat16)
    assert encode_tensor("w", last.clone(), last) == []
    new = last.clone()
    new[3, 5], new[60, 0] = 1.5, -2.0
    entries = encode_tensor("w", new, last)
    assert [n for n, _ in entries] == ["w" + DELTA_INDEX, "w" + DELTA_VALUE]
    assert entries[0][1].tolist() == [3 * 32 + 5, 60 * 32]
    receiver = last.clone()
    apply_sparse(receiver, entries[0][1], entries[1][1])
    assert torch.equal(receiver.view(torch.int16), new.view(torch.int16))
    everything = new + 1
    assert encode_tensor("w", everything, last) == [("w", everything)]  # sparse would be larger
    with pytest.raises(ValueError, match="index out of range"):
        apply_sparse(receiver, torch.tensor([64 * 32]), torch.tensor([1.0]))
    with pytest.raises(ValueError, match="indices but no"):
        split_entries({"w" + DELTA_INDEX: torch.tensor([1])})


def test_the_tracker_sends_what_changed_at_the_receivers_dtype():
    torch.manual_seed(0)
    weights = {"a": torch.randn(128, 16), "b": torch.randn(16)}
    tracker = DeltaTracker()
    first = dict(tracker.encode(weights.items(), torch.bfloat16))
    assert set(first) == {"a", "b"} and tracker.stats["bytes"] == tracker.stats["full_bytes"] == (128 * 16 + 16) * 2
    weights["a"] = weights["a"] + 1e-5  # below bf16's resolution for almost every element
    weights["a"][0, 0] += 1.0
    second = dict(tracker.encode(weights.items(), torch.bfloat16))
    assert "b" not in second and tracker.stats["skipped"] == 1 and tracker.stats["bytes"] < tracker.stats["full_bytes"] / 10
    receiver = first["a"].clone()
    apply_sparse(receiver, second["a" + DELTA_INDEX], second["a" + DELTA_VALUE])
    assert torch.equal(receiver, weights["a"].to(torch.bfloat16))
    untouched = dict(tracker.encode(weights.items(), torch.bfloat16))  # nothing changed: one empty delta
    assert [v.numel() for v in untouched.values()] == [0, 0]


def _model(tok, seed, dtype=torch.float32):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tok),
                                        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)).to(dtype)


@pytest.mark.slow
def test_grpo_against_a_bf16_server_syncs_deltas_exactly(tmp_path, monkeypatch):
    from datasets import Dataset

    from hf_verl.trainers.grpo_trainer import GRPOTrainer
    from tests.test_grpo_trainer import count_a
    from tests.test_serve import _server_grpo_args

    tok = build_char_tokenizer()
    served = _model(tok, 1, torch.bfloat16)
    server = RolloutServer(TransformersEngine(served, tok), tok, "tiny", port=0, token=TOKEN).start()
    monkeypatch.setenv("HF_VERL_SERVE_TOKEN", TOKEN)
    try:
        policy = _model(tok, 0)
        args = _server_grpo_args(tmp_path, server, max_steps=3, learning_rate=1e-6)  # TRL's default
        trainer = GRPOTrainer(model=policy, reward_funcs=count_a, args=args, processing_class=tok,
                              train_dataset=Dataset.from_dict({"prompt": ["abc", "xyz"] * 4}))
        assert trainer.engine.weight_sync_mode == "auto" and trainer.engine.accepts_weight_deltas
        sent = []
        sync = trainer.engine.sync_weights

        def counting(named):
            pairs = list(named)
            sent.append(sum(t.numel() * t.element_size() for _, t in pairs))
            return sync(pairs)

        trainer.engine.sync_weights = counting
        trainer.train()
        full = sum(p.numel() * 2 for p in policy.state_dict().values())
        assert sent[0] == full and all(s < full / 2 for s in sent[1:]), (sent, full)
        assert trainer.engine.last_sync_stats["full_bytes"] == full
        assert server.engine.weight_version == len(sent)
        for name, p in policy.state_dict().items():  # exact at the server's dtype
            assert torch.equal(served.state_dict()[name], p.to(torch.bfloat16)), name
    finally:
        server.shutdown()


def test_a_malformed_delta_is_refused_and_changes_nothing():
    from hf_verl.rollout.remote import RemoteEngine, RolloutServerError

    tok = build_char_tokenizer()
    model = _model(tok, 0)
    server = RolloutServer(TransformersEngine(model, tok), tok, "tiny", port=0, token=TOKEN).start()
    try:
        before = {k: v.clone() for k, v in model.state_dict().items()}
        remote = RemoteEngine(server.address, token=TOKEN)
        name = "model.norm.weight"
        with pytest.raises(RolloutServerError, match="integer indices within"):
            remote.sync_weights([(name + DELTA_INDEX, torch.tensor([10_000], dtype=torch.int32)),
                                 (name + DELTA_VALUE, torch.tensor([1.0]))])
        with pytest.raises(RolloutServerError, match="indices but no"):
            remote.sync_weights([(name + DELTA_INDEX, torch.tensor([0], dtype=torch.int32))])
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
        with urllib.request.urlopen(f"{server.address}/v1/weights/version") as resp:
            assert json.loads(resp.read()) == {"weight_version": 0, "dtype": "float32", "in_flight": True}
    finally:
        server.shutdown()


def test_delta_is_refused_for_an_engine_that_takes_whole_tensors():
    from hf_verl.pipeline.sync import uses_delta_sync

    tok = build_char_tokenizer()
    engine = TransformersEngine(_model(tok, 0), tok)
    assert not uses_delta_sync(engine)  # auto: in-process, full
    engine.weight_sync_mode = "delta"
    with pytest.raises(ValueError, match="weight_sync='delta' needs a rollout engine that applies sparse deltas"):
        uses_delta_sync(engine)
    engine.weight_sync_mode = "partial"
    with pytest.raises(ValueError, match="weight_sync must be"):
        uses_delta_sync(engine)
