"""A generator fleet (`placement={"generator": [url1, url2]}`, :class:`~hf_verl.rollout.fleet.FleetEngine`) against
two real `hf-verl serve` processes started with their token, as tests/test_serve_training.py starts one:

- balancing: both servers answer requests, and the completions come back in prompt order, equal to one server's
  greedy ones;
- a server killed between rounds: its request is retried, then goes to the other; training goes on, every prompt has
  its completion and every completion is scored once;
- the server restarted on its original weights: the fleet sees the stale weight version (by probing it while it
  was down, or from an answer when its restart went unseen), gives it no prompts, re-syncs it at the next weight
  sync, and then both servers serve the trained actor's greedy completions;
- every server down: the error names both URLs.

The fast tests check the list form of `placement` and the registry's choice without servers.
"""

import copy
import logging
import os
import socket
import subprocess
import sys

import pytest
import torch

from hf_verl.pipeline.placement import check_placement
from hf_verl.rollout.base import SamplingParams
from hf_verl.rollout.fleet import FleetEngine, FleetUnavailable
from hf_verl.rollout.hf_engine import TransformersEngine
from hf_verl.rollout.registry import RolloutEngineContext, make_rollout_engine
from hf_verl.rollout.remote import RemoteEngine
from tests.conftest import build_char_tokenizer
from tests.test_serve_training import _model

TOKEN = "a-token-only-the-trainer-knows"
PROMPTS = ["abc", "xyz", "hello", "ab"]
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)
A, B = "http://127.0.0.1:8000", "http://127.0.0.1:8001"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Servers:
    """Two `hf-verl serve` processes on one saved model (seed 7, not the policy's), each restartable on its port and
    its original weights; their output goes to a log file each."""

    def __init__(self, folder, tok) -> None:
        self.folder, self.tok = folder, tok
        self.ports = [_free_port(), _free_port()]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        self.procs: list = [None, None]

    def start(self, i: int) -> None:
        env = dict(os.environ, HF_HUB_OFFLINE="1", HF_VERL_SERVE_TOKEN=TOKEN)
        with open(self.folder.parent / f"server{i}.log", "ab") as log:
            self.procs[i] = subprocess.Popen([sys.executable, "-m", "hf_verl", "serve", str(self.folder), "--port",
                                              str(self.ports[i])], stdout=log, stderr=subprocess.STDOUT, env=env)
        RemoteEngine(self.urls[i], max_retries=40, backoff_s=0.25).generate([self.tok("a")["input_ids"]], GREEDY)

    def kill(self, i: int) -> None:
        self.procs[i].kill()
        self.procs[i].wait(timeout=30)

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)


@pytest.fixture
def servers(tmp_path, monkeypatch):
    tok = build_char_tokenizer()
    _model(tok, seed=7).save_pretrained(tmp_path / "served")
    tok.save_pretrained(tmp_path / "served")
    fleet = Servers(tmp_path / "served", tok)
    monkeypatch.setenv("HF_VERL_SERVE_TOKEN", TOKEN)
    try:
        fleet.start(0)
        fleet.start(1)
        yield fleet
    finally:
        fleet.stop_all()


def _greedy(url, tok, model):
    """The server's greedy completions of PROMPTS and the model's own."""
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    local = TransformersEngine(copy.deepcopy(model).eval(), tok).generate(prompts, GREEDY)
    return RemoteEngine(url).generate(prompts, GREEDY).completion_ids, local.completion_ids


# ---------------------------------------------------------------------------------------------- without servers
def test_placement_takes_a_list_of_generator_urls():
    out = check_placement({"generator": [A, B]}, has_reference=None, has_critic=None, world_size=1, engines=())
    assert out["generator"] == (A, B)
    one = check_placement({"generator": [A]}, has_reference=None, has_critic=None, world_size=1, engines=())
    assert one["generator"] == A  # a one-URL list is that URL
    for bad, said in (([], "empty list"), ([A, "fsdp2"], "not URLs"), ([A, A + "/v1"], "more than once")):
        with pytest.raises(ValueError, match=said):
            check_placement({"generator": bad}, has_reference=None, has_critic=None, world_size=1, engines=())
    with pytest.raises(ValueError, match="generator's server"):
        check_placement({"generator": [A, B], "reference": B + "/v1"}, has_reference=None, has_critic=None,
                        world_size=1, engines=())


def test_a_list_of_urls_builds_a_fleet_engine():
    from hf_verl import GRPOConfig

    engine = make_rollout_engine("fleet", RolloutEngineContext(urls=(A, B), token=TOKEN))
    assert isinstance(engine, FleetEngine) and engine.urls == [A, B] and engine.serves_every_rank
    assert all(m.engine.token == TOKEN for m in engine.members)
    args = GRPOConfig(output_dir="/tmp/unused", use_cpu=True, report_to=[], placement={"generator": [A, B]})
    assert isinstance(args.placement["generator"], list)


def test_the_facade_reports_a_fleet(monkeypatch):
    from hf_verl import Trainer

    monkeypatch.setenv("HF_VERL_SERVE_TOKEN", TOKEN)
    tok = build_char_tokenizer()
    trainer = Trainer(actor_model=_model(tok, seed=0), reward_model=lambda completions, **kw: [0.0] * len(completions),
                      tokenizer=tok, placement={"generator": [A, B]})
    assert isinstance(trainer.engine, FleetEngine) and trainer.engine.states() == {A: "live", B: "live"}
    assert trainer.placement()[-1].startswith(f"generator: backend=FleetEngine where={A}, {B} ")


# ---------------------------------------------------------------------------------------------- real servers
@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_fleet_balances_and_keeps_prompt_order(servers):
    tok = servers.tok
    prompts = [tok(p)["input_ids"] for p in PROMPTS * 2]
    fleet = FleetEngine(servers.urls, prompts_per_request=2)
    out = fleet.generate(prompts, GREEDY)
    one = RemoteEngine(servers.urls[0]).generate(prompts, GREEDY)
    assert out.completion_ids == one.completion_ids and out.finish_reasons == one.finish_reasons
    assert all(v > 0 for v in fleet.requests_served().values()), fleet.requests_served()
    assert sum(fleet.requests_served().values()) == 4  # 8 prompts in requests of 2, each answered once
    streamed = dict(fleet.generate_stream(prompts, GREEDY, chunk_rows=3))
    assert sorted(streamed) == [0, 3, 6]
    assert [c for o in sorted(streamed) for c in streamed[o].completion_ids] == one.completion_ids


@pytest.mark.slow
@pytest.mark.multiprocess
def test_training_survives_a_server_that_dies_and_comes_back(servers, caplog):
    from hf_verl import Trainer

    tok, (url_a, url_b) = servers.tok, servers.urls
    scored = []

    def count_a(completions, **kwargs):
        scored.append(len(completions))
        return [float(c.count("a")) + 0.1 * len(c) for c in completions]

    policy = _model(tok, seed=0)
    trainer = Trainer(actor_model=policy, reward_model=count_a, tokenizer=tok, placement={"generator": [url_a, url_b]},
                      config={"num_generations": 4, "max_completion_length": 5, "learning_rate": 1e-2,
                              "use_async_rollout": False})
    fleet = trainer.engine
    assert isinstance(fleet, FleetEngine) and fleet.urls == [url_a, url_b]
    for m in fleet.members:  # a dead server is given up after 0.1 + 0.2 + 0.4 s of retries
        m.engine.backoff_s = 0.1

    def round_(expect_b: str):
        before = fleet.requests_served()
        rollout = trainer.rollout(PROMPTS)
        assert rollout.prompts == [p for p in PROMPTS for _ in range(4)]  # every prompt, in order
        assert len(rollout.completions) == 16 and scored[-1] == 16  # each completion scored once
        assert fleet.states()[url_b] == expect_b, fleet.states()
        trainer.step(trainer.compute_loss(rollout))
        return {u: fleet.requests_served()[u] - before[u] for u in before}

    caplog.set_level(logging.INFO, logger="hf_verl.rollout.fleet")
    served = round_("live")
    assert served[url_a] > 0 and served[url_b] > 0  # both servers take requests

    servers.kill(1)  # between rounds: its next request fails after the retries, then goes to the other server
    served = round_("down")
    assert served[url_b] == 0 and served[url_a] > 0
    assert any(r.levelno == logging.WARNING and url_b in r.getMessage() and "down" in r.getMessage()
               for r in caplog.records)

    servers.start(1)  # back on its original (untrained) weights at version 0: stale until the next sync
    served = round_("stale")
    assert served[url_b] == 0
    assert any(url_b in r.getMessage() and "re-synced" in r.getMessage() for r in caplog.records)
    assert fleet.states()[url_b] == "live"  # the step's sync brought it back

    served = round_("live")
    assert served[url_a] > 0 and served[url_b] > 0  # it rejoined

    servers.kill(1)  # restarted unseen between two rounds: its answer on version 0 is dropped, the other redoes it
    servers.start(1)
    caplog.clear()
    served = round_("stale")  # stale during the rollout, re-synced by the step
    assert served[url_b] == 0
    assert any(url_b in r.getMessage() and "other weights" in r.getMessage() for r in caplog.records)

    for url in (url_a, url_b):  # the run ends on the trained weights on every server
        got, want = _greedy(url, tok, policy)
        assert got == want, url
    assert len(scored) == 5 and all(n == 16 for n in scored)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_every_server_down_names_each_url(servers):
    fleet = FleetEngine(servers.urls, max_retries=1, backoff_s=0.1)
    prompts = [servers.tok(p)["input_ids"] for p in PROMPTS]
    fleet.generate(prompts, GREEDY)
    servers.kill(0)
    servers.kill(1)
    with pytest.raises(FleetUnavailable) as err:
        fleet.generate(prompts, GREEDY)
    message = str(err.value)
    assert all(f"{url}: down, " in message and "unreachable" in message for url in servers.urls), message
    with pytest.raises(FleetUnavailable, match="take the weights"):
        fleet.sync_weights(iter([("model.norm.weight", torch.ones(32))]))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_grpo_trainer_trains_against_a_fleet(servers, tmp_path):
    from datasets import Dataset

    from hf_verl import GRPOConfig, GRPOTrainer

    tok = servers.tok
    policy = _model(tok, seed=0)
    args = GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], max_steps=3, logging_steps=1,
                      per_device_train_batch_size=4, num_generations=4, max_completion_length=5, learning_rate=1e-2,
                      gradient_checkpointing=False, save_strategy="no", disable_tqdm=True,
                      placement={"generator": servers.urls})
    trainer = GRPOTrainer(model=policy, reward_funcs=lambda completions, **kw: [float(c.count("a")) for c in
                                                                                 completions],
                          args=args, processing_class=tok, train_dataset=Dataset.from_dict({"prompt": PROMPTS * 2}))
    assert isinstance(trainer.engine, FleetEngine) and trainer.engine.urls == servers.urls
    trainer.train()
    assert len([h for h in trainer.state.log_history if "loss" in h]) == 3
    served = trainer.engine.requests_served()
    assert sum(served.values()) == 3 and all(n > 0 for n in served.values()), served  # one request a round, in turn
    assert trainer.engine.weight_version == 4  # a sync per round and one at the end of train(), on both servers
    for url in servers.urls:
        got, want = _greedy(url, tok, policy)
        assert got == want, url
