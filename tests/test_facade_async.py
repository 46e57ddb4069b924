"""Asynchronous rollout of the facade `hf_verl.Trainer`: prefetch, staleness, the actor copy,
engines with their own weights, background errors, importance sampling, `rollouts()`."""

import logging
import threading
import time

import pytest
import torch

from tests.conftest import build_char_tokenizer
from tests.test_facade import changed, count_a, snapshot, tiny_llama
from tests.test_facade import make_trainer as make_sync_trainer

ROWS = [{"prompt": p} for p in ["abc=", "hello", "xyz a", "ab", "cab=", "b a c", "aaa", "zz"]]


def make_trainer(tok=None, **kwargs):
    """The facade with asynchronous rollout on (off by default, as in the trainers)."""
    config = {"use_async_rollout": True, **kwargs.pop("config", {})}
    return make_sync_trainer(tok, config=config, **kwargs)


def dataset_trainer(**config):
    cfg = dict(rollout_batch_size=2, **config)
    return make_trainer(dataset=ROWS, config=cfg, **cfg.pop("trainer_kwargs", {}))


def one_step(trainer, rollout):
    return trainer.step(trainer.compute_loss(rollout))


class Gate:
    """A reward function that records which thread scores and, once armed, blocks background calls
    until released."""

    def __init__(self):
        self.threads, self.armed = [], False
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self, prompts, completions, **kwargs):
        self.threads.append(threading.current_thread())
        if self.armed and threading.current_thread() is not threading.main_thread():
            self.entered.set()
            assert self.release.wait(30), "the test never released the gate"
        return count_a(prompts, completions, None)


# ---------------------------------------------------------------------- prefetch
def test_next_rollout_is_generated_in_the_background_while_the_caller_steps():
    gate = Gate()
    trainer = dataset_trainer(trainer_kwargs={"reward_model": gate})
    gate.armed = True
    first = trainer.rollout()  # synchronous (nothing prefetched yet), then rollout 2 starts in the background
    assert gate.threads[0] is threading.main_thread()
    assert gate.entered.wait(30), "the prefetch did not start"
    one_step(trainer, first)  # runs while the background rollout is blocked inside its reward function
    assert trainer.global_step == 1 and not trainer._rounds.pending["dataset"].future.done()
    gate.release.set()
    second = trainer.rollout()
    assert gate.threads[1] is not threading.main_thread()
    assert second.metrics["rollout/prefetched"] == 1.0 and first.metrics["rollout/prefetched"] == 0.0
    assert second.metrics["time/rollout_wait_s"] >= 0.0 and second.metrics["time/generate_s"] > 0.0
    assert second.trace_id != first.trace_id and len(second.trace_id) == 12
    trainer.close()


def test_prefetched_rows_are_the_rows_the_synchronous_path_draws():
    sync_trainer, async_trainer = dataset_trainer(use_async_rollout=False), dataset_trainer()
    sync_prompts, async_prompts = [], []
    for _ in range(5):  # 10 rows of 8: crosses into the second shuffled epoch
        for trainer, seen in ((sync_trainer, sync_prompts), (async_trainer, async_prompts)):
            rollout = trainer.rollout()
            seen.append(rollout.prompts[::4])
            one_step(trainer, rollout)
    assert async_prompts == sync_prompts
    assert sorted(p for batch in sync_prompts[:4] for p in batch) == sorted(r["prompt"] for r in ROWS)
    assert async_trainer._rounds.prefetcher.copy_engine is not None
    assert sync_trainer._rounds.prefetcher.copy_engine is None
    async_trainer.close()


# ---------------------------------------------------------------------- staleness
def test_staleness_is_one_after_the_first_step_and_weight_versions_follow():
    trainer = dataset_trainer()
    stale, versions = [], []
    for _ in range(4):
        rollout = trainer.rollout()
        stale.append(rollout.metrics["rollout/staleness"])
        versions.append(rollout.weight_version.unique().tolist())
        assert rollout.meta["weights_step"] == trainer.global_step - stale[-1]
        metrics = one_step(trainer, rollout)
    assert stale == [0, 1, 1, 1] and max(stale) <= trainer.config.max_staleness
    assert versions == [[0], [0], [1], [2]]  # rollout k (k >= 2) used the weights of step k - 2
    assert metrics["rollout/staleness"] == 1 and metrics["weight_version"] == 4
    trainer.close()


def test_max_staleness_zero_is_synchronous():
    gate = Gate()
    trainer = dataset_trainer(max_staleness=0, trainer_kwargs={"reward_model": gate})
    for _ in range(3):
        rollout = trainer.rollout()
        assert rollout.metrics["rollout/staleness"] == 0 and rollout.metrics["rollout/prefetched"] == 0.0
        one_step(trainer, rollout)
    assert all(t is threading.main_thread() for t in gate.threads) and len(gate.threads) == 3
    assert trainer._rounds.prefetcher.copy_engine is None and not trainer._rounds.pending


def test_staleness_over_the_limit_is_a_clear_error_and_the_prompts_are_kept():
    trainer = dataset_trainer()
    rollout = trainer.rollout()
    for mb in rollout.split(4):  # two steps on one rollout: the prefetch is 2 steps old
        one_step(trainer, mb)
    with pytest.raises(RuntimeError, match=r"staleness 2 exceeds config.max_staleness=1.*max_staleness >= 2"):
        trainer.rollout()
    pending = trainer._rounds.pending["dataset"]
    trainer.config.max_staleness = 2
    second = trainer.rollout()
    assert second.metrics["rollout/staleness"] == 2 and second.prompts[::4] == [r["prompt"] for r in pending.item]
    trainer.config.use_async_rollout = False  # the pending prefetch is regenerated with the current weights
    one_step(trainer, second)
    third = trainer.rollout()
    assert third.metrics["rollout/staleness"] == 0 and third.metrics["rollout/prefetched"] == 0.0
    trainer.close()


# ---------------------------------------------------------------------- the actor copy
def copy_params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_copy_engine_is_synced_between_generations_and_never_mutated_during_one():
    trainer = dataset_trainer()
    first = trainer.rollout()
    copy_engine = trainer._rounds.prefetcher.copy_engine
    assert copy_engine is not trainer.engine and copy_engine.model is not trainer.model
    actor = dict(trainer.model.named_parameters())
    for name, p in copy_engine.model.named_parameters():
        assert torch.equal(p, actor[name]) and p.data_ptr() != actor[name].data_ptr() and not p.requires_grad
    one_step(trainer, first)
    trainer._rounds.pending["dataset"].future.result()  # rollout 2 is done; rollout 3 will block inside generate

    entered, release, seen = threading.Event(), threading.Event(), {}
    generate = copy_engine.generate

    def blocking_generate(prompt_ids, sampling, **kwargs):
        seen["start"] = copy_params(copy_engine.model)
        entered.set()
        assert release.wait(30)
        out = generate(prompt_ids, sampling, **kwargs)
        seen["end"] = copy_params(copy_engine.model)
        return out

    copy_engine.generate = blocking_generate
    second = trainer.rollout()  # copy synced to step 1, then rollout 3 generates on it in the background
    assert entered.wait(30) and trainer._rounds.prefetcher.copy_step == 1
    actor_at_1 = snapshot(trainer.model)
    assert all(torch.equal(seen["start"][n], p) for n, p in actor_at_1.items())  # copy == actor after sync
    one_step(trainer, second)  # the optimizer moves the actor while the copy generates
    assert changed(actor_at_1, trainer.model)
    release.set()
    third = trainer.rollout()  # hands out rollout 3, then syncs the copy to step 2 for rollout 4
    assert all(torch.equal(seen["end"][n], p) for n, p in actor_at_1.items())  # untouched while generating
    assert third.metrics["rollout/staleness"] == 1 and trainer._rounds.prefetcher.copy_step == 2
    assert all(torch.equal(p, actor[n]) for n, p in copy_engine.model.named_parameters())
    trainer.close()
    assert trainer._rounds.prefetcher.copy_engine is None


def make_own_weights_engine(tok, gate_event):
    from hf_verl.rollout.base import RolloutEngine
    from hf_verl.rollout.hf_engine import TransformersEngine

    class Engine(RolloutEngine):
        def __init__(self):
            super().__init__()
            self.inner = TransformersEngine(tiny_llama(tok), tok)
            self.generating = False
            self.events = []

        def generate(self, prompt_ids, sampling, row_seeds=None):
            self.generating = True
            self.events.append(("generate", threading.current_thread() is threading.main_thread()))
            if threading.current_thread() is not threading.main_thread():
                assert gate_event.wait(30)
            try:
                return self.inner.generate(prompt_ids, sampling, row_seeds=row_seeds)
            finally:
                self.generating = False

        def sync_weights(self, named_tensors):
            assert not self.generating, "sync_weights while a generation runs"
            self.events.append(("sync", self.weight_version))
            self.inner.sync_weights(named_tensors)
            self._bump_version()

    return Engine()


def test_engine_with_its_own_weights_is_used_as_is_and_its_sync_is_deferred():
    tok = build_char_tokenizer()
    release = threading.Event()
    engine = make_own_weights_engine(tok, release)
    trainer = make_trainer(tok, actor=tiny_llama(tok), rollout_engine=engine, dataset=ROWS,
                           config={"rollout_batch_size": 2})
    first = trainer.rollout()
    assert trainer._rounds.prefetcher.copy_engine is None
    # an engine with its own weights gets the actor's before it first generates (a server may hold others)
    assert engine.events == [("sync", 0), ("generate", True), ("generate", False)]
    metrics = one_step(trainer, first)  # the background generation is still waiting: sync deferred
    assert metrics["weight_version"] == 1 and ("sync", 1) not in engine.events and trainer._rounds.sync_deferred
    release.set()
    second = trainer.rollout()  # hands out rollout 2, syncs, then starts rollout 3
    assert engine.events[3] == ("sync", 1) and engine.weight_version == 2
    assert second.metrics["rollout/staleness"] == 1 and second.meta["off_policy"]
    assert first.meta["off_policy"]  # another engine's numerics: importance sampling applies from the start
    metrics = one_step(trainer, second)
    assert "sampling/importance_sampling_ratio/mean" in metrics
    trainer.close()  # waits for rollout 3's generation
    assert engine.events[4] == ("generate", False) and len(engine.events) in (5, 6)


# ---------------------------------------------------------------------- errors, training
def test_a_reward_error_in_the_background_surfaces_at_the_next_rollout():
    calls = []

    def flaky(prompts, completions, **kwargs):
        calls.append(threading.current_thread())
        if len(calls) == 2:
            raise ValueError("the grader is down (reward call 2)")
        return [0.0] * len(completions)

    trainer = dataset_trainer(trainer_kwargs={"reward_model": flaky})
    one_step(trainer, trainer.rollout())
    with pytest.raises(ValueError, match=r"the grader is down \(reward call 2\)"):
        trainer.rollout()
    assert calls[1] is not threading.main_thread()
    assert trainer.rollout().metrics["rollout/prefetched"] == 0.0  # the next call starts afresh
    trainer.close()


def test_async_training_changes_parameters_with_a_finite_loss():
    trainer = dataset_trainer()
    before = snapshot(trainer.model)
    for _ in range(3):
        rollout = trainer.rollout()
        loss = trainer.compute_loss(rollout)
        assert torch.isfinite(loss)
        metrics = trainer.step(loss)
    moved = changed(before, trainer.model)
    assert len(moved) >= 0.9 * len(before), f"only {len(moved)}/{len(before)} params changed"
    for key in ("time/generate_s", "time/reward_s", "time/old_logprobs_s", "time/rollout_wait_s",
                "time/weight_sync_s", "sampling/importance_sampling_ratio/mean", "rollout/staleness"):
        assert key in metrics, key
    trainer.close()


# ---------------------------------------------------------------------- importance sampling
def test_importance_weights_are_one_on_policy_and_truncated_at_the_cap():
    trainer = make_trainer(config={"importance_sampling_mode": "token_truncate", "importance_sampling_clip_max": 2.0})
    rollout = trainer.rollout(["abc=", "hello"])
    assert rollout.meta["off_policy"] is False
    rollout.advantages = torch.ones_like(rollout.advantages)  # policy loss -mean(ratio) = -1 at ratio 1
    plain = trainer.compute_loss(rollout).item()
    assert plain == pytest.approx(-1.0, abs=1e-5) and "sampling/importance_sampling_ratio/mean" not in \
        trainer._loss_metrics
    rollout.meta["off_policy"] = True
    rollout.sampling_logprobs = rollout.old_logprobs.clone()  # behaviour == old: weights 1
    same = trainer.compute_loss(rollout).item()
    m = trainer._loss_metrics
    assert same == pytest.approx(plain, rel=1e-6)
    assert m["sampling/importance_sampling_ratio/min"] == m["sampling/importance_sampling_ratio/max"] == 1.0
    rollout.sampling_logprobs = rollout.old_logprobs - 5.0  # ratio e^5 on every token: truncated at 2
    capped = trainer.compute_loss(rollout).item()
    m = trainer._loss_metrics
    assert m["sampling/importance_sampling_ratio/max"] == 2.0 and m["sampling/importance_sampling_ratio/min"] == 2.0
    assert m["sampling/sampling_logp_difference/mean"] == pytest.approx(5.0)
    assert capped == pytest.approx(2.0 * plain, rel=1e-5)
    trainer.config.importance_sampling_correction = False  # metrics still logged, loss unweighted
    assert trainer.compute_loss(rollout).item() == pytest.approx(plain, rel=1e-6)
    assert trainer._loss_metrics["sampling/importance_sampling_ratio/max"] == 2.0


def test_missing_sampling_logprobs_skip_the_correction_with_one_log_line(caplog):
    trainer = make_trainer()
    rollout = trainer.rollout(["abc="])
    plain = trainer.compute_loss(rollout).item()
    rollout.meta["off_policy"], rollout.sampling_logprobs = True, None
    caplog.set_level(logging.INFO, logger="hf_verl.facade")
    for _ in range(2):
        assert trainer.compute_loss(rollout).item() == pytest.approx(plain, rel=1e-6)
    lines = [r.getMessage() for r in caplog.records if "no sampling log-probs" in r.getMessage()]
    assert len(lines) == 1 and "sampling/importance_sampling_ratio/mean" not in trainer._loss_metrics


# ---------------------------------------------------------------------- rollouts(), explicit batches, close
def test_rollouts_prefetches_each_next_batch_in_order():
    gate = Gate()
    batches = [["abc=", "hello"], ["xyz a"], ["ab", "cab=", "zz"]]
    with make_trainer(reward_model=gate) as trainer:
        seen, stale = [], []
        for rollout in trainer.rollouts(batches):
            seen.append(rollout.prompts[::4])
            one_step(trainer, rollout)
            stale.append(rollout.metrics["rollout/staleness"])
        assert seen == batches and stale == [0, 1, 1] and trainer.global_step == 3
        assert [t is threading.main_thread() for t in gate.threads] == [True, False, False]
        for rollout in trainer.rollouts(batches):  # an early break leaves nothing behind
            break
        assert not trainer._rounds.pending
    assert trainer._rounds.prefetcher._executor is None


def test_rollouts_without_async_is_sequential():
    gate = Gate()
    trainer = make_trainer(reward_model=gate, config={"use_async_rollout": False})
    assert [r.prompts[::4] for r in trainer.rollouts([["abc="], ["xyz a"]])] == [["abc="], ["xyz a"]]
    assert all(t is threading.main_thread() for t in gate.threads)
    assert trainer._rounds.prefetcher.copy_engine is None


def test_explicit_batches_are_synchronous_and_say_so_once(caplog):
    caplog.set_level(logging.INFO, logger="hf_verl.facade")
    trainer = make_trainer()
    for _ in range(2):
        rollout = trainer.rollout(["abc="])
        assert rollout.metrics["rollout/prefetched"] == 0.0 and rollout.metrics["rollout/staleness"] == 0
        one_step(trainer, rollout)
    lines = [r.getMessage() for r in caplog.records if "not prefetched" in r.getMessage()]
    assert len(lines) == 1 and "trainer.rollouts(" in lines[0]
    assert not trainer._rounds.pending and trainer._rounds.prefetcher.copy_engine is None


def test_a_generation_setting_changed_during_a_prefetch_regenerates_its_rows():
    trainer = dataset_trainer()
    first = trainer.rollout()
    one_step(trainer, first)
    rows = trainer._rounds.pending["dataset"].item
    trainer.config.group_size = 2
    second = trainer.rollout()
    assert second.batch_size == 4 and second.prompts[::2] == [r["prompt"] for r in rows]
    assert second.metrics["rollout/prefetched"] == 0.0 and second.metrics["rollout/staleness"] == 0
    trainer.close()


def test_close_stops_the_worker_in_bounded_time():
    trainer = dataset_trainer()
    trainer.rollout()
    t0 = time.perf_counter()
    trainer.close()
    assert time.perf_counter() - t0 < 30 and trainer._rounds.prefetcher._executor is None
    assert not trainer._rounds.pending
    assert trainer.rollout().metrics["rollout/prefetched"] == 0.0  # usable again: a new worker
    trainer.close()


def test_async_settings_defaults_and_validation():
    from hf_verl.facade.config import TrainerConfig

    cfg = TrainerConfig()  # the seed's defaults: asynchronous, one step stale; the trainers' masking above a ratio of 3
    assert (cfg.use_async_rollout, cfg.max_staleness, cfg.importance_sampling_correction) == (True, 1, True)
    assert (cfg.rollout_batch_size, cfg.lam) == (16, 0.95)
    assert (cfg.importance_sampling_mode, cfg.importance_sampling_clip_min, cfg.importance_sampling_clip_max) == (
        "sequence_mask", None, 3.0)
    with pytest.raises(ValueError, match=r"max_staleness must be an int >= 0, got -1"):
        cfg.max_staleness = -1
    with pytest.raises(ValueError, match=r"importance_sampling_mode \(vllm_importance_sampling_mode\) must be one of"):
        cfg.importance_sampling_mode = "token_clip"
    with pytest.raises(TypeError, match="use_async_rollout must be True or False"):
        cfg.use_async_rollout = 1
