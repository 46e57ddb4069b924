"""Continuous batching (`hf_verl.rollout.continuous`) and rounds generated ahead (`async_rollout_depth`, partial
rollouts): overlapping `generate` calls share one decode loop, rows join and leave between steps, and every row
gets what the plain loop gives it (greedy, or one seed per row) within float rounding; in-flight weight updates
land between two of its steps; GRPO trains with rounds generated ahead, in data order, and refuses what cannot hold.
"""

import copy
import threading
import time

import pytest
import torch

from hf_verl.rollout.base import SamplingParams
from hf_verl.rollout.continuous import pad_left
from hf_verl.rollout.hf_engine import TransformersEngine
from tests.conftest import build_char_tokenizer
from tests.test_in_flight import _model, update_while_held


def _frozen(seed=0):
    tok = build_char_tokenizer()
    return tok, _model(tok, seed).eval().requires_grad_(False)


def _close(a, b, tol=1e-5):
    assert a.completion_ids == b.completion_ids
    assert a.finish_reasons == b.finish_reasons
    assert max(abs(x - y) for la, lb in zip(a.logprobs, b.logprobs) for x, y in zip(la, lb)) < tol


def test_pad_left():
    t = torch.arange(6.0).view(1, 2, 3)
    out = pad_left(t, 5, dim=-1, value=-1)
    assert out.shape == (1, 2, 5) and out[0, 0].tolist() == [-1, -1, 0, 1, 2]
    assert pad_left(t, 3, dim=-1) is t


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_one_call_and_overlapping_calls_equal_the_plain_loop(temperature):
    tok, model = _frozen()
    plain, cont = TransformersEngine(model, tok), TransformersEngine(model, tok, continuous_batching=True)
    prompts = [tok(t).input_ids for t in ["hello", "abc", "what is 2+2?", "x", "count to five", "ab"]]
    seeds = list(range(100, 106))
    sampling = SamplingParams(max_new_tokens=24, temperature=temperature)
    _close(plain.generate(prompts, sampling, row_seeds=seeds), cont.generate(prompts, sampling, row_seeds=seeds))
    # three calls at once (different lengths, overlapping rows): one decode loop, each call its own rows back
    parts = [(prompts[:4], seeds[:4]), (prompts[2:], seeds[2:]), (prompts[1:2], seeds[1:2])]
    got, threads = {}, []
    for k, (ps, ss) in enumerate(parts):
        threads.append(threading.Thread(target=lambda k=k, ps=ps, ss=ss: got.update({k: cont.generate(ps, sampling,
                                                                                                       row_seeds=ss)})))
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for k, (ps, ss) in enumerate(parts):
        _close(plain.generate(ps, sampling, row_seeds=ss), got[k])
    cont.close()


def test_rows_join_a_running_decode_and_leave_it_when_done():
    tok, model = _frozen()
    plain = TransformersEngine(model, tok)
    plain.eos_token_ids = set()
    cont = TransformersEngine(model, tok, continuous_batching=True, batch_size=3)  # at most 3 rows at once
    cont.eos_token_ids = set()
    greedy = SamplingParams(max_new_tokens=20, temperature=0.0)
    long_rows = [tok("abc").input_ids, tok("hello there").input_ids]
    late = [tok("x").input_ids, tok("yz").input_ids]
    # the first call is held inside its 5th forward until the second call's rows queue: they join mid-decode
    out, forwards, reached, release = {}, [0], threading.Event(), threading.Event()

    def hold(*_):
        forwards[0] += 1
        if forwards[0] == 5:
            reached.set()
            assert release.wait(30)

    hook = model.register_forward_hook(hold)
    first = threading.Thread(target=lambda: out.update(first=cont.generate(long_rows, greedy)))
    second = threading.Thread(target=lambda: out.update(late=cont.generate(late, SamplingParams(max_new_tokens=6,
                                                                                                temperature=0.0))))
    first.start()
    assert reached.wait(30)
    second.start()
    while len(cont._decoder._waiting) < 2:
        time.sleep(0.001)
    release.set()
    first.join(60)
    second.join(60)
    hook.remove()
    _close(plain.generate(long_rows, greedy), out["first"])
    _close(plain.generate(late, SamplingParams(max_new_tokens=6, temperature=0.0)), out["late"])
    decoder = cont._decoder
    assert decoder.peak_rows == 3  # the cap held: one late row waited for a place
    # 19 forwards for the long rows; the late rows rode in them instead of adding steps of their own
    assert decoder.steps == 19
    cont.close()


def test_an_update_lands_between_two_continuous_steps():
    tok, old = _frozen(0)
    _, new = _frozen(1)
    engine = TransformersEngine(copy.deepcopy(old), tok, continuous_batching=True)
    engine.tag_token_versions = True
    engine.eos_token_ids = set()
    prompts = [tok("abc").input_ids, tok("hello").input_ids]
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0)
    out = update_while_held(engine, 3, lambda: engine.generate(prompts, greedy),
                            lambda: engine.sync_weights(new.state_dict().items()))
    assert out.extra["token_versions"] == [[0] * 3 + [1] * 7] * 2
    before = TransformersEngine(old, tok).generate(prompts, greedy)
    assert all(r[:3] == b[:3] for r, b in zip(out.completion_ids, before.completion_ids))
    engine.close()


def test_what_continuous_batching_refuses_or_leaves_to_the_plain_loop():
    tok = build_char_tokenizer()
    trained = _model(tok, 0)
    with pytest.raises(ValueError, match="only generates"):
        TransformersEngine(trained, tok, continuous_batching=True)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    sliding = Qwen2ForCausalLM(Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tok),
                                           use_sliding_window=True, sliding_window=8, max_window_layers=1,
                                           layer_types=["full_attention", "sliding_attention"]))
    with pytest.raises(ValueError, match="continuous_batching is not available"):
        TransformersEngine(sliding.requires_grad_(False), tok, continuous_batching=True)
    # a repetition penalty decodes alone in the plain loop, with the same result
    _, model = _frozen()
    cont, plain = TransformersEngine(model, tok, continuous_batching=True), TransformersEngine(model, tok)
    penalised = SamplingParams(max_new_tokens=8, temperature=0.0, repetition_penalty=1.3)
    prompts = [tok("abcabc").input_ids]
    _close(plain.generate(prompts, penalised), cont.generate(prompts, penalised))
    assert cont._decoder.steps == 0
    cont.close()


def _grpo(tmp_path, **kw):
    from hf_verl import GRPOTrainer
    from tests.test_grpo_options import PROMPTS
    from tests.test_grpo_trainer import _args

    tok, seen = build_char_tokenizer(), []

    def record(prompts, completions, **_):  # the prompts of each scored round, in order
        seen.append(list(prompts))
        return [float(c.count("a")) for c in completions]

    model = _model(tok, 0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = GRPOTrainer(model=model, reward_funcs=record, args=_args(tmp_path, **kw), train_dataset=PROMPTS,
                          processing_class=tok)
    trainer.train()
    changed = any(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    return trainer, [h for h in trainer.state.log_history if "loss" in h], changed, seen


@pytest.mark.slow
def test_grpo_with_rounds_generated_ahead_trains_in_data_order(tmp_path, caplog):
    kw = {"max_steps": 6, "max_completion_length": 12}
    with caplog.at_level("INFO", logger="hf_verl"):
        trainer, logs, changed, ahead = _grpo(tmp_path / "ahead", use_async_rollout=True,
                                              in_flight_weight_updates=True, async_rollout_depth=3, max_staleness=3,
                                              **kw)
    *_, in_order = _grpo(tmp_path / "sync", **kw)
    # the same rounds as a synchronous run (scored in the background as they finish, so in any order), each served
    # for its own step: a round whose rows are not the step's would be rolled out again, with a warning
    assert changed and sorted(ahead) == sorted(in_order) and len(ahead) == 6
    assert not [r for r in caplog.records if "does not match" in r.getMessage() or "dropping" in r.getMessage()]
    assert trainer._rounds.prefetcher.copy_engine is None  # closed at the end of train()
    staleness = [h["rollout/token_staleness_mean"] for h in logs if "rollout/token_staleness_mean" in h]
    assert staleness and max(staleness) <= 3 and all(h["rollout/stale_tokens_masked"] == 0.0 for h in logs[1:])


@pytest.mark.slow
def test_rounds_ahead_need_in_flight_updates_and_a_staleness_bound(tmp_path):
    with pytest.raises(ValueError, match="set in_flight_weight_updates=True"):
        _grpo(tmp_path / "a", max_steps=2, use_async_rollout=True, async_rollout_depth=2, max_staleness=2)
    with pytest.raises(ValueError, match="set max_staleness >= 3"):
        _grpo(tmp_path / "b", max_steps=2, use_async_rollout=True, async_rollout_depth=3,
              in_flight_weight_updates=True, max_staleness=1)


@pytest.mark.slow
def test_the_facade_rolls_out_rounds_ahead():
    from hf_verl import Trainer
    from tests.test_facade import count_a

    tok = build_char_tokenizer()
    trainer = Trainer(actor_model=_model(tok, 0), reward_model=count_a, tokenizer=tok,
                      config={"group_size": 4, "max_new_tokens": 12, "seed": 0, "use_async_rollout": True,
                              "in_flight_weight_updates": True, "max_staleness": 3, "async_rollout_depth": 3,
                              "actor_lr": 1e-2})
    staleness = []
    for rollout in trainer.rollouts([["abc", "hello"]] * 6):
        metrics = trainer.step(trainer.compute_loss(rollout))
        assert torch.isfinite(torch.tensor(metrics["grad_norm/actor"]))
        staleness.append(rollout.metrics.get("rollout/token_staleness_mean", 0.0))
    assert len(staleness) == 6 and 0 < max(staleness) <= 3  # rounds were served from 3 generated ahead
    assert not trainer._rounds.pending and not trainer._rounds.queued


def test_hf_verl_serve_decodes_concurrent_requests_together_and_updates_after_them():
    from hf_verl.rollout.remote import RemoteEngine
    from hf_verl.serve.server import RolloutServer

    tok, old = _frozen(0)
    _, new = _frozen(1)
    served = TransformersEngine(copy.deepcopy(old), tok)
    served.eos_token_ids = set()
    server = RolloutServer(served, tok, "tiny", port=0, token="t0k", continuous_batching=True).start()
    plain = TransformersEngine(old, tok)
    plain.eos_token_ids = set()
    try:
        remote = RemoteEngine(server.address, token="t0k")
        prompts = [[tok(t).input_ids] for t in ("abc", "hello", "x")]
        lengths = (12, 4, 8)
        got, threads = {}, []
        for k, (p, n) in enumerate(zip(prompts, lengths)):
            greedy = SamplingParams(max_new_tokens=n, temperature=0.0)
            threads.append(threading.Thread(target=lambda k=k, p=p, g=greedy: got.update({k: remote.generate(p, g)})))
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for k, (p, n) in enumerate(zip(prompts, lengths)):
            assert got[k].completion_ids == plain.generate(p, SamplingParams(max_new_tokens=n,
                                                                            temperature=0.0)).completion_ids
        assert served._decoder.steps < sum(lengths) - len(lengths)  # requests shared decode steps
        # an update that is not in flight waits for the generation in progress (held at its 3rd forward)
        greedy = SamplingParams(max_new_tokens=10, temperature=0.0)
        forwards, reached, release, out = [0], threading.Event(), threading.Event(), {}

        def hold(*_):
            forwards[0] += 1
            if forwards[0] == 3:
                reached.set()
                assert release.wait(30)

        hook = served.model.register_forward_hook(hold)
        worker = threading.Thread(target=lambda: out.update(gen=remote.generate(prompts[0], greedy)))
        worker.start()
        assert reached.wait(30)
        updating = threading.Thread(target=lambda: remote.sync_weights(new.state_dict().items()))
        updating.start()
        deadline = time.time() + 30
        while not server.lock._waiting:  # the upload waits for the lock's exclusive side
            assert time.time() < deadline
            time.sleep(0.001)
        release.set()
        worker.join(30)
        updating.join(30)
        hook.remove()
        assert out["gen"].completion_ids == plain.generate(prompts[0], greedy).completion_ids  # all old weights
        assert out["gen"].weight_version == 0 and served.weight_version == remote.weight_version == 1
    finally:
        server.shutdown()
