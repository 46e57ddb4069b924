"""Per-role placement in the facade: declarations checked at construction, `placement()` one line per role."""

import pytest

from tests.conftest import build_char_tokenizer
from tests.test_facade import count_a, tiny_llama

CONFIG = dict(group_size=2, max_new_tokens=2, seed=0, use_async_rollout=False)


def _trainer(**kwargs):
    from hf_verl import Trainer

    tok = build_char_tokenizer()
    kwargs.setdefault("reward_model", count_a)
    return Trainer(actor_model=tiny_llama(tok), tokenizer=tok, config=CONFIG, **kwargs)


def test_default_placement_is_everything_colocated_one_line_per_role(caplog):
    import logging

    tok = build_char_tokenizer()
    trainer = _trainer(reference_model=tiny_llama(tok, seed=2),
                       reward_model=[count_a, "http://127.0.0.1:9/v1/classify"])
    with caplog.at_level(logging.INFO, logger="hf_verl.facade.trainer"):
        lines = trainer.placement()
    roles = [line.split(": backend=")[0] for line in lines]
    assert roles == ["actor", "reference", "reward[count_a]", "reward[127.0.0.1:9]", "generator"]
    assert lines[0] == "actor: backend=plain where=rank 0 (colocated) layout=one process memory=n/a"
    assert lines[1].startswith("reference: backend=plain where=rank 0 (colocated) ")
    assert lines[2] == "reward[count_a]: backend=callable where=rank 0 layout=python memory=n/a"
    assert "where=http://127.0.0.1:9/v1/classify layout=remote" in lines[3]
    assert lines[4].startswith("generator: backend=TransformersEngine where=rank 0 layout=colocated")
    assert sum("placement: " in r.getMessage() for r in caplog.records) == len(lines)


def test_a_generator_url_becomes_a_remote_engine():
    from hf_verl.rollout.remote import RemoteEngine

    trainer = _trainer(placement={"generator": "http://127.0.0.1:9"})
    assert isinstance(trainer.engine, RemoteEngine) and trainer.engine.base_url == "http://127.0.0.1:9"
    assert trainer.placement()[-1].startswith("generator: backend=RemoteEngine where=http://127.0.0.1:9 layout=remote")


def test_a_reference_on_its_own_layout_is_reported_so():
    tok = build_char_tokenizer()
    trainer = _trainer(reference_model=tiny_llama(tok, seed=2), placement={"reference": "ddp"})
    assert "(own layout)" in trainer.placement()[1]


@pytest.mark.parametrize("placement, message", [
    ({"critic": "fsdp2"}, r"placement\['critic'\] = 'fsdp2' but no critic model was given: pass critic_model="),
    ({"reference": "fsdp2", "_ref": True}, r"shards over processes but this launch has one: launch 2 or more"),
    ({"reference": "megatron", "_ref": True}, r"set config backend='megatron'"),
    ({"reference": "tp4", "_ref": True}, r"choose 'colocated' or one of"),
    ({"generator": "localhost:8000"}, r"use 'colocated' or the URL of a /v1/completions server"),
    ({"actor": "ddp"}, r"the actor runs on the launch's layout"),
    ({"reward": "http://x"}, r"a reward model is placed by what reward_model= is"),
    ({"value": "ddp"}, r"unknown role 'value'"),
])
def test_a_role_that_cannot_run_where_declared_fails_at_construction(placement, message):
    tok = build_char_tokenizer()
    extra = {"reference_model": tiny_llama(tok, seed=2)} if placement.pop("_ref", False) else {}
    with pytest.raises(ValueError, match=message):
        _trainer(placement=placement, **extra)


def test_a_generator_url_and_an_engine_together_are_refused():
    from hf_verl.rollout.hf_engine import TransformersEngine

    tok = build_char_tokenizer()
    with pytest.raises(ValueError, match="placement\\['generator'\\] is a URL but a rollout engine was given"):
        _trainer(placement={"generator": "http://127.0.0.1:9"},
                 rollout_engine=TransformersEngine(tiny_llama(tok), tok))
