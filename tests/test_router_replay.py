"""Rollout routing replay and the routing metrics of Mixture-of-Experts models (hf_verl.moe).

The tap records what a real TransformersEngine rollout routed each token to (prefill deduplicated over a group's
repeated prompts included), the batch carries it through padding and slicing, and a replayed forward hands the
experts modules exactly the recorded experts with the router's own gate-weight formula (replaying the router's own
choice is bit-identical to no replay). Across the precisions that make routing differ (a bf16 rollout, an fp32
training forward) routing disagrees without replay and the experts used are the rollout's with it. GRPOTrainer,
PPOTrainer and the facade train with `router_replay=True` and log the metrics; a dense actor is refused.
"""

import pytest
import torch
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from hf_verl.data.batch import RolloutBatch
from hf_verl.engine.registry import RoleLayout, make_engine
from hf_verl.moe import RoutingTap, routing_metrics
from hf_verl.moe.metrics import same_experts
from hf_verl.parallel.backend import BackendSpec
from hf_verl.parallel.dims import ParallelDims
from hf_verl.pipeline.generation import batch_from_output
from hf_verl.rollout.base import SamplingParams
from hf_verl.rollout.hf_engine import TransformersEngine
from tests.conftest import build_char_tokenizer

LAYOUT = RoleLayout(BackendSpec(), ParallelDims())


def moe_model(tok, family="qwen3_moe", seed=0, hidden=32, experts=8, layers=2):
    torch.manual_seed(seed)
    common = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2, vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                  eos_token_id=tok.eos_token_id)
    if family == "qwen3_moe":
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(head_dim=hidden // 4, moe_intermediate_size=hidden,
                                                  num_experts=experts, norm_topk_prob=True, **common))
    if family == "qwen2_moe":  # shared expert, no renormalisation of the top-k
        return Qwen2MoeForCausalLM(Qwen2MoeConfig(moe_intermediate_size=hidden, shared_expert_intermediate_size=hidden,
                                                  num_experts=experts, norm_topk_prob=False, **common))
    return MixtralForCausalLM(MixtralConfig(num_local_experts=experts, **common))


def _rollout(model, tok, prompts, autocast_dtype=None, max_new_tokens=8, seed=1):
    engine = TransformersEngine(model, tok, autocast_dtype=autocast_dtype)
    engine.record_routing = True
    ids = [tok(p).input_ids for p in prompts]
    out = engine.generate(ids, SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, seed=seed))
    return batch_from_output(ids, prompts, out, tok, "cpu")


def _forward(model, batch, replay=None):
    """Logits of the batch's tokens, the routers' own choices and the experts each experts module was handed."""
    tap, handed = RoutingTap.of(model), []
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    hooks = [e.register_forward_pre_hook(lambda mod, args: handed.append(args[1].clone())) for e in experts]
    mask = batch.attention_mask
    try:
        with torch.no_grad(), tap.recording(replay):
            logits = model(input_ids=batch.input_ids, attention_mask=mask,
                           position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
            natural = tap.take()
    finally:
        for h in hooks:
            h.remove()
    return logits, natural, torch.stack(handed, dim=1)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_the_rollout_records_what_it_routed_and_replay_routes_there(family):
    tok = build_char_tokenizer()
    model = moe_model(tok, family)
    prompts = ["abc", "hello", "abc", "xy"]  # a repeated prompt: the engine prefills it once
    batch = _rollout(model, tok, prompts)
    L, k = len(RoutingTap.of(model).routers), 2
    B, P, C = batch.batch_size, batch.prompt_ids.shape[1], batch.completion_ids.shape[1]
    assert batch.prompt_routed_experts.shape == (B, P, L, k) and batch.completion_routed_experts.shape == (B, C, L, k)
    record = batch.routed_experts.reshape(-1, L, k).long()
    real = batch.attention_mask.reshape(-1).bool()
    recorded = (record >= 0).all(-1).all(-1)
    # padding has no record; each completion's last token has none (no forward consumed it); every other real
    # token has one
    assert not (recorded & ~real).any()
    lengths = batch.completion_mask.sum(-1)
    last = torch.zeros(B, P + C, dtype=torch.bool)
    last[torch.arange(B), P + lengths - 1] = True
    assert torch.equal(recorded, real & ~last.reshape(-1))

    # the same weights and precision, teacher-forced: the routers choose what the rollout recorded
    logits, natural, handed = _forward(model, batch)
    assert same_experts(natural, record)[recorded].all()
    # replaying the routers' own choice changes nothing, bit for bit
    replayed_logits, _, _ = _forward(model, batch, replay=natural)
    assert torch.equal(logits, replayed_logits)
    # replaying other experts hands the experts modules exactly those, with the router's weight rule
    torch.manual_seed(3)
    other = torch.stack([torch.randperm(8)[:k] for _ in range(natural.shape[0] * L)]).view(-1, L, k)
    changed, _, handed = _forward(model, batch, replay=other)
    assert torch.equal(handed, other) and not torch.allclose(changed, logits)


def test_a_bf16_rollout_routes_differently_from_fp32_training_and_replay_closes_it():
    tok = build_char_tokenizer()
    model = moe_model(tok, hidden=64, experts=16, layers=3)
    batch = _rollout(model, tok, ["abc", "hello", "xyz", "ab", "hey"] * 2, autocast_dtype=torch.bfloat16,
                     max_new_tokens=16)
    L = len(RoutingTap.of(model).routers)
    record = batch.routed_experts.reshape(-1, L, 2).long()
    recorded = (record >= 0).all(-1)
    _, natural, handed = _forward(model, batch)
    assert not same_experts(natural, record)[recorded].all()  # bf16 vs fp32 flips some tokens' experts
    _, _, handed = _forward(model, batch, replay=record)
    assert same_experts(handed, record)[recorded].all()  # with replay: every recorded token routed alike


def test_the_engine_replays_only_when_asked_and_logs_the_metrics():
    tok = build_char_tokenizer()
    model = moe_model(tok, hidden=64, experts=16, layers=3)
    batch = _rollout(model, tok, ["abc", "hello", "xyz", "ab", "hey"] * 2, autocast_dtype=torch.bfloat16,
                     max_new_tokens=16)
    engine = make_engine(model, "actor", LAYOUT, trainable=True)
    logp_own, _, _ = engine.logprobs(batch, with_aux_loss=True)
    own = engine.take_routing_metrics()
    assert own["moe/replayed_tokens"] == 0.0 and 0 < own["moe/routing_agreement"] < 1.0
    engine.router_replay = True
    logp_replayed, _, _ = engine.logprobs(batch, with_aux_loss=True)
    replayed = engine.take_routing_metrics()
    real = int(batch.attention_mask.sum())
    assert replayed["moe/replayed_tokens"] == pytest.approx((real - batch.batch_size) / real)
    assert replayed["moe/routing_agreement"] == own["moe/routing_agreement"]  # the routers' own choice, measured
    assert not torch.allclose(logp_own, logp_replayed)
    # the replayed log-probs are closer to the bf16 rollout's own
    mask = batch.completion_mask.bool()
    gap = lambda lp: (lp - batch.sampling_logprobs)[mask].abs().mean()
    assert gap(logp_replayed) < gap(logp_own)
    for name in ("moe/expert_load_cv", "moe/expert_load_max", "moe/expert_load_cv/layer_0"):
        assert own[name] > 0
    with pytest.raises(ValueError, match="carries no routing record"):
        engine.logprobs(RolloutBatch(batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask))


def test_a_packed_padding_free_forward_replays_as_the_padded_one():
    tok = build_char_tokenizer()
    model = moe_model(tok, hidden=64, experts=16, layers=3)
    batch = _rollout(model, tok, ["abc", "hello there", "xyz", "ab"] * 2, autocast_dtype=torch.bfloat16,
                     max_new_tokens=12)
    out = {}
    for padding_free in (False, True):
        engine = make_engine(model, "actor", LAYOUT, trainable=True, padding_free=padding_free)
        engine.router_replay = True
        out[padding_free] = engine.logprobs(batch)[0], engine.take_routing_metrics()
    torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-5, atol=1e-5)
    assert out[True][1]["moe/replayed_tokens"] == pytest.approx(out[False][1]["moe/replayed_tokens"])
    assert out[True][1]["moe/routing_agreement"] == pytest.approx(out[False][1]["moe/routing_agreement"])


def test_routing_metrics_on_a_hand_made_record():
    natural = torch.tensor([[[0, 1]], [[2, 3]], [[1, 0]], [[0, 2]]])  # 4 tokens, 1 layer, top-2, 4 experts
    record = torch.tensor([[[1, 0]], [[2, 1]], [[-1, -1]], [[0, 2]]])
    out = routing_metrics(natural, torch.tensor([1, 1, 1, 0]), 4, recorded=record, replayed=True)
    assert out["moe/routing_agreement"] == pytest.approx(1 / 2)  # tokens 0 (same set) and 1 (differs); 2 none
    assert out["moe/replayed_tokens"] == pytest.approx(2 / 3)
    # used: token 0 -> {1,0}, token 1 -> {2,1}, token 2 (no record) -> {1,0}: loads [2, 3, 1, 0]
    load = torch.tensor([2.0, 3.0, 1.0, 0.0])
    assert out["moe/expert_load_cv"] == pytest.approx(float(load.std(unbiased=False) / load.mean()))
    assert out["moe/expert_load_max"] == pytest.approx(3 / 1.5)


def test_routing_fields_follow_the_batch_through_padding_and_slicing():
    tok = build_char_tokenizer()
    batch = _rollout(moe_model(tok), tok, ["abc", "hello", "xy"])
    padded = batch.pad_to_multiple(8, tok.pad_token_id)
    assert padded.prompt_routed_experts.shape[1] == padded.prompt_ids.shape[1] == 8
    assert torch.equal(padded.routed_experts[:, 8 - batch.prompt_ids.shape[1] : 8 + batch.completion_ids.shape[1]],
                       batch.routed_experts)
    assert (padded.prompt_routed_experts[:, : 8 - batch.prompt_ids.shape[1]] == -1).all()
    assert torch.equal(batch.select([2]).routed_experts, batch.routed_experts[2:3])
    bad = RolloutBatch(batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask,
                       prompt_routed_experts=batch.prompt_routed_experts[:, :-1])
    with pytest.raises(ValueError, match="prompt_routed_experts has shape"):
        bad.validate()


@pytest.mark.slow
def test_grpo_ppo_and_the_facade_train_with_router_replay(tmp_path):
    from tests.test_grpo_options import _train

    tok = build_char_tokenizer()
    trainer, logs, changed = _train(tmp_path / "grpo", model=moe_model(tok), max_steps=2, router_replay=True)
    assert changed and trainer.engine.record_routing and trainer.actor.router_replay
    assert 0.8 < logs[-1]["moe/replayed_tokens"] < 1.0 and logs[-1]["moe/routing_agreement"] == 1.0
    with pytest.raises(ValueError, match="needs a Mixture-of-Experts actor"):
        from tests.test_grpo_trainer import _model

        _train(tmp_path / "dense", model=_model(tok), max_steps=1, router_replay=True)

    from datasets import Dataset

    from hf_verl import PPOTrainer, Trainer
    from tests.test_facade import count_a
    from tests.test_ppo_trainer import _args as ppo_args

    ds = Dataset.from_dict({"prompt": ["abc", "b", "hello", "xy"] * 2})
    ppo = PPOTrainer(args=ppo_args(tmp_path / "ppo", advantage_estimator="rloo", num_generations=4, max_steps=1,
                                   kl_coef=0.0, router_replay=True),
                     processing_class=tok, model=moe_model(tok), reward_model=count_a, train_dataset=ds)
    ppo.train()
    assert ppo.state.log_history[0]["moe/replayed_tokens"] > 0.8

    facade = Trainer(actor_model=moe_model(tok), reward_model=count_a, tokenizer=tok,
                     config=dict(group_size=2, max_new_tokens=6, seed=0, use_async_rollout=False, router_replay=True))
    rollout = facade.rollout(["abc", "hello"])
    assert rollout.completion_routed_experts is not None
    metrics = facade.step(facade.compute_loss(rollout))
    assert metrics["moe/replayed_tokens"] > 0.8 and metrics["moe/routing_agreement"] == 1.0


def test_hf_verl_serve_returns_the_routing_and_the_remote_engine_carries_it():
    import copy
    import json
    import urllib.error
    import urllib.request

    from hf_verl.rollout.remote import RemoteEngine
    from hf_verl.serve.server import RolloutServer

    tok = build_char_tokenizer()
    model = moe_model(tok)
    server = RolloutServer(TransformersEngine(copy.deepcopy(model), tok), tok, "tiny", port=0).start()
    dense = None
    try:
        prompts = [tok(p).input_ids for p in ("abc", "hello", "abc")]
        greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
        remote = RemoteEngine(server.address)
        remote.record_routing = True
        served = remote.generate(prompts, greedy)
        local = TransformersEngine(model, tok)
        local.record_routing = True
        expected = local.generate(prompts, greedy)
        assert served.completion_ids == expected.completion_ids
        assert all(torch.equal(a.long(), b.long()) for a, b in zip(served.routed_experts, expected.routed_experts))

        def post(url, body):
            req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req) as resp:
                return json.loads(resp.read())

        plain = post(server.address, {"prompt": [prompts[0]], "max_tokens": 3})
        assert "routed_experts" not in plain["choices"][0]
        from tests.test_grpo_trainer import _model

        dense = RolloutServer(TransformersEngine(_model(tok), tok), tok, "dense", port=0).start()
        with pytest.raises(urllib.error.HTTPError) as err:
            post(dense.address, {"prompt": [prompts[0]], "max_tokens": 3, "return_routed_experts": True})
        assert err.value.code == 400 and "Mixture-of-Experts" in err.value.read().decode()
    finally:
        server.shutdown()
        if dense is not None:
            dense.shutdown()


def test_vllm_routing_needs_its_gpu_runner():
    from hf_verl.rollout.vllm_engine import VLLMEngine

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine runs vLLM's routed-experts output")
    with pytest.raises(ValueError, match="Model Runner V2 only, and that needs Triton"):
        VLLMEngine("unused", record_routing=True)
