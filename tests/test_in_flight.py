"""In-flight weight updates (partial rollouts): a weight update lands in a running generation between two decode
steps, unfinished completions continue under the new weights, and every token carries the version behind it.

The engine test makes the timing deterministic: a forward hook holds decode step n until the update is waiting
at the engine's turnstile, so the update must land right after step n. The front-end tests train with
`in_flight_weight_updates=True` (the facade and GRPOTrainer) on completions long enough that the optimizer step
arrives while the next rollout generates, and check the per-token versions, their metrics and the staleness mask.
"""

import copy
import threading
import time

import pytest
import torch

from hf_verl.data.batch import RolloutBatch
from hf_verl.pipeline.generation import batch_from_output
from hf_verl.rollout.base import SamplingParams
from hf_verl.rollout.hf_engine import TransformersEngine
from tests.conftest import build_char_tokenizer


def _model(tok, seed):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tok),
                                        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id))


def hold_forward(model, held: int):
    """A forward hook that holds `model` inside its forward number `held` (the weights lock is then held); returns
    `(reached, release, remove)`: an event set once it holds, the event that releases it, and the hook's remover."""
    reached, release, forwards = threading.Event(), threading.Event(), [0]

    def hold(_module, _args, _out):
        forwards[0] += 1
        if forwards[0] == held:
            reached.set()
            assert release.wait(60)

    return reached, release, model.register_forward_hook(hold).remove


def land_update_while_held(engine, hold, generate, update):
    """Run `generate()` in a thread until `hold` (a `(reached, release, remove)` triple) holds the engine inside a
    step, start `update()` in another thread, wait until that update waits at the engine's turnstile (so it must
    land right after the held step), then release both; returns what `generate()` returned."""
    reached, release, remove = hold
    result = {}
    try:
        worker = threading.Thread(target=lambda: result.update(out=generate()))
        worker.start()
        assert reached.wait(60)
        updating = threading.Thread(target=update)
        updating.start()
        deadline = time.time() + 60
        while not engine._turnstile.locked():
            assert time.time() < deadline
            time.sleep(0.001)
        release.set()
        updating.join(60)
        worker.join(60)
    finally:
        release.set()
        remove()
    return result["out"]


def update_while_held(served: TransformersEngine, held: int, generate, update):
    """:func:`land_update_while_held` with `served`'s model held inside forward number `held`."""
    return land_update_while_held(served, hold_forward(served.model, held), generate, update)


@pytest.mark.parametrize("held", [1, 4])
def test_an_update_lands_between_two_decode_steps_and_tags_every_token(held):
    tok = build_char_tokenizer()
    old, new = _model(tok, 0), _model(tok, 1)
    engine = TransformersEngine(copy.deepcopy(old), tok)
    engine.tag_token_versions = True
    engine.eos_token_ids = set()  # every completion runs to the length limit
    prompts = [tok("abc").input_ids, tok("hello").input_ids]
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    out = update_while_held(engine, held, lambda: engine.generate(prompts, greedy),
                            lambda: engine.sync_weights(new.state_dict().items()))
    # forward `held` gave token held-1's logits under the old weights; every later token is the new weights'
    assert out.extra["token_versions"] == [[0] * held + [1] * (12 - held)] * 2
    assert engine.weight_version == 1
    assert all(torch.equal(p, new.state_dict()[n]) for n, p in engine.model.state_dict().items())
    before = TransformersEngine(old, tok).generate(prompts, greedy)
    for row, ref in zip(out.completion_ids, before.completion_ids):
        assert row[:held] == ref[:held]
    assert out.completion_ids != before.completion_ids  # the rest continued under the new weights
    batch = batch_from_output(prompts, ["abc", "hello"], out, tok, "cpu")
    assert batch.token_weight_version.tolist() == out.extra["token_versions"]
    assert isinstance(batch.select([1]), RolloutBatch) and batch.select([1]).token_weight_version.shape == (1, 12)


def test_without_in_flight_updates_no_token_is_tagged():
    tok = build_char_tokenizer()
    out = TransformersEngine(_model(tok, 0), tok).generate([tok("abc").input_ids],
                                                           SamplingParams(max_new_tokens=4, temperature=0.0))
    assert "token_versions" not in out.extra


@pytest.mark.slow
def test_the_facade_trains_with_updates_landing_in_flight():
    from hf_verl import Trainer
    from tests.test_facade import count_a

    tok = build_char_tokenizer()
    model = _model(tok, 0)
    model.generation_config.eos_token_id = None
    trainer = Trainer(actor_model=model, reward_model=count_a, tokenizer=tok,
                      config={"group_size": 4, "max_new_tokens": 200, "seed": 0, "use_async_rollout": True,
                              "in_flight_weight_updates": True, "max_staleness": 1, "actor_lr": 1e-2})
    trainer.engine.eos_token_ids = set()  # long completions: the next rollout is still generating at step()
    seen = []
    for rollout in trainer.rollouts([["abc", "hello"]] * 3):
        metrics = trainer.step(trainer.compute_loss(rollout))
        seen.append((rollout.metrics, metrics, rollout.token_weight_version, rollout.completion_mask))
    # rounds 2 and 3 were generated while the actor stepped: updates landed, tokens span two versions
    landed = [m for m, *_ in seen if m.get("rollout/in_flight_updates", 0) > 0]
    assert landed, [m.get("rollout/in_flight_updates") for m, *_ in seen]
    for m, step_metrics, versions, mask in seen[1:]:
        assert versions is not None and torch.isfinite(torch.tensor(step_metrics["grad_norm/actor"]))
        real = versions[mask.bool()]
        assert m["rollout/token_version_spread"] == float(real.max() - real.min())
        assert (versions[:, 1:] >= versions[:, :-1])[mask[:, 1:].bool()].all()  # a row's versions never go back
    assert max(m["rollout/token_version_spread"] for m, *_ in seen[1:]) >= 1


@pytest.mark.slow
def test_grpo_masks_tokens_older_than_the_staleness_bound(tmp_path):
    from tests.test_grpo_options import _train

    tok = build_char_tokenizer()
    _, logs, changed = _train(tmp_path, model=_model(tok, 0), max_steps=4, use_async_rollout=True,
                              in_flight_weight_updates=True, steps_per_generation=2, max_completion_length=16)
    assert changed
    served = [h for h in logs if "rollout/token_staleness_mean" in h]
    assert served and all(h["rollout/stale_tokens_masked"] == 0.0 for h in served)  # within max_staleness=1


@pytest.mark.slow
def test_grpo_updates_land_in_flight_with_one_optimizer_step_per_round(tmp_path):
    """The default `steps_per_generation` (one optimizer step per round): the weights of each step go into the
    round generating meanwhile. (The update runs inside the optimizer step, before the Trainer counts it; it used to
    compare the uncounted step with the copy's and skip every update.)"""
    from tests.test_grpo_options import _train

    tok = build_char_tokenizer()
    model = _model(tok, 0)
    # every forward without grad (generation) sleeps: a round's 24 decode forwards take far longer than a training
    # step, so each optimizer step ends while the next round generates (the actor copy is a deep copy: it keeps the
    # hook, and decodes through the model's forward)
    model.register_forward_hook(lambda *_: None if torch.is_grad_enabled() else time.sleep(0.02))
    _, logs, changed = _train(tmp_path, model=model, max_steps=4, use_async_rollout=True,
                              in_flight_weight_updates=True, max_completion_length=24)
    assert changed
    landed = [h.get("rollout/in_flight_updates", 0.0) for h in logs]
    assert sum(landed) >= 1, landed
    assert max(h.get("rollout/token_version_spread", 0.0) for h in logs) >= 1


def test_hf_verl_serve_takes_an_update_in_flight_and_reports_each_tokens_version():
    from hf_verl.rollout.remote import RemoteEngine
    from hf_verl.serve.server import RolloutServer

    tok = build_char_tokenizer()
    old, new = _model(tok, 0), _model(tok, 1)
    served = TransformersEngine(copy.deepcopy(old), tok)
    served.eos_token_ids = set()
    server = RolloutServer(served, tok, "tiny", port=0, token="t0k").start()
    try:
        remote = RemoteEngine(server.address, token="t0k")
        assert remote.supports_in_flight_updates
        remote.tag_token_versions = True
        held = 3
        prompt = [tok("abc").input_ids]
        greedy = SamplingParams(max_new_tokens=10, temperature=0.0)
        out = update_while_held(served, held, lambda: remote.generate(prompt, greedy),
                                lambda: remote.sync_weights(new.state_dict().items()))
        assert out.extra["token_versions"] == [[0] * held + [1] * (10 - held)]
        assert remote.weight_version == served.weight_version == 1
        before = TransformersEngine(old, tok).generate(prompt, greedy).completion_ids[0]
        assert out.completion_ids[0][:held] == before[:held]
    finally:
        server.shutdown()


@pytest.mark.slow
def test_grpo_in_flight_against_a_server_and_a_fleet_refused(tmp_path, monkeypatch):
    from datasets import Dataset

    from hf_verl.serve.server import RolloutServer
    from hf_verl.trainers.grpo_trainer import GRPOTrainer
    from tests.test_grpo_trainer import _args, count_a

    tok = build_char_tokenizer()
    servers = [RolloutServer(TransformersEngine(_model(tok, 1), tok), tok, "tiny", port=0, token="t0k").start()
               for _ in range(2)]
    monkeypatch.setenv("HF_VERL_SERVE_TOKEN", "t0k")
    try:
        args = _args(tmp_path / "one", max_steps=3, use_async_rollout=True, in_flight_weight_updates=True,
                     placement={"generator": servers[0].address})
        trainer = GRPOTrainer(model=_model(tok, 0), reward_funcs=count_a, args=args, processing_class=tok,
                              train_dataset=Dataset.from_dict({"prompt": ["abc", "xyz"] * 4}))
        trainer.train()
        served = [h for h in trainer.state.log_history if "rollout/token_staleness_mean" in h]
        assert served and all(h["rollout/stale_tokens_masked"] == 0.0 for h in served)
        assert servers[0].engine.weight_version == trainer.engine.weight_version >= 3
        args = _args(tmp_path / "fleet", max_steps=2, use_async_rollout=True, in_flight_weight_updates=True,
                     placement={"generator": [s.address for s in servers]})
        trainer = GRPOTrainer(model=_model(tok, 0), reward_funcs=count_a, args=args, processing_class=tok,
                              train_dataset=Dataset.from_dict({"prompt": ["abc", "xyz"] * 4}))
        with pytest.raises(ValueError, match="in_flight_weight_updates=True needs a rollout engine that takes"):
            trainer.train()
    finally:
        for s in servers:
            s.shutdown()


def test_tokens_older_than_max_staleness_are_masked_and_the_metrics_say_so():
    from types import SimpleNamespace

    from hf_verl.pipeline.orchestrator import Round, RoundHost, RoundOrchestrator
    from hf_verl.pipeline.rounds import Collected

    settings = SimpleNamespace(in_flight_weight_updates=True, use_async_rollout=True, max_staleness=1)
    orchestrator = RoundOrchestrator(RoundHost(settings=settings, rows=list, prepare=list, collect=None,
                                               engine=lambda: None, actor=lambda: None, dims=None,
                                               global_step=lambda: 3, version=lambda: 3))
    batch = RolloutBatch.from_lists([[1, 2], [3]], [[4, 5, 6, 7], [8, 9]], 0)
    batch.token_weight_version = torch.tensor([[0, 0, 1, 2], [1, 1, 0, 0]])  # the engine's own versions
    orchestrator._versions[7] = {0: 1, 1: 2, 2: 3}  # engine version -> policy version, as its syncs recorded
    served = Round(Collected([], batch, torch.zeros(2, 1), 0, {}, None), 1, 1, off_policy=False, engine_key=7)
    assert orchestrator._token_versions(served, pushes=2)
    assert batch.token_weight_version.tolist() == [[1, 1, 2, 3], [2, 2, 1, 1]]
    # policy version 1 lags 2 > max_staleness=1 behind version 3: those tokens leave the loss
    assert batch.completion_mask.tolist() == [[0, 0, 1, 1], [1, 1, 0, 0]]
    assert served.metrics == pytest.approx({"rollout/token_version_spread": 2.0, "rollout/token_staleness_mean": 7 / 6,
                                            "rollout/stale_tokens_masked": 2 / 6, "rollout/in_flight_updates": 2.0})
    assert served.off_policy

