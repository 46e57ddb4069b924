"""One default per setting: every config dataclass field that carries a schema setting (hf_verl.settings) has the
schema's default (or the front-end's own, declared in the schema with its reason), and is validated by the schema's
one mechanism, with the same message the facade gives."""

import dataclasses

import pytest

from hf_verl import DPOConfig, GRPOConfig, PPOConfig, RLOOConfig
from hf_verl.facade.config import TrainerConfig
from hf_verl.settings import DEPARTURES, SETTINGS, check_setting

CONFIGS = {"grpo": GRPOConfig, "ppo": PPOConfig, "rloo": RLOOConfig, "dpo": DPOConfig}


def _carried(cls, front_end):
    """(schema name, Setting, field name, dataclass field) of every schema setting `cls` carries."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name, setting in SETTINGS.items():
        attr = setting.name_in(front_end, name)
        if attr in fields:
            yield name, setting, attr, fields[attr]


def _default(f):
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING


@pytest.mark.parametrize("front_end", sorted(CONFIGS))
def test_every_config_default_is_the_schemas(front_end):
    carried = list(_carried(CONFIGS[front_end], front_end))
    assert len(carried) >= (10 if front_end == "dpo" else 40)  # the test reads the configs, not an empty list
    for name, setting, attr, f in carried:
        assert _default(f) == setting.default_for(front_end), f"{front_end} {attr} ({name})"


def test_every_front_end_default_is_declared_with_its_reason():
    declared = {(name, fe) for name, s in SETTINGS.items() for fe in s.defaults}
    assert declared == set(DEPARTURES)
    assert ("temperature", "ppo") in declared and ("use_async_rollout", "facade") in declared
    config = TrainerConfig()
    for name, setting in SETTINGS.items():
        assert getattr(config, name) == setting.default_for("facade"), name


@pytest.mark.parametrize("front_end", sorted(CONFIGS))
def test_every_config_validates_as_the_schema(front_end, tmp_path):
    cls, bad = CONFIGS[front_end], object()
    checked = 0
    for name, setting, attr, _ in _carried(cls, front_end):
        if not setting.trainers:
            continue
        with pytest.raises(TypeError) as want:
            check_setting(cls.__name__, name, bad, spelled=attr)
        with pytest.raises(TypeError) as got:
            cls(output_dir=str(tmp_path), use_cpu=True, **{attr: bad})
        assert str(got.value) == str(want.value), f"{front_end} {attr}"
        checked += 1
    assert checked >= (5 if front_end == "dpo" else 35)


def test_the_facade_validates_as_the_schema():
    bad = object()
    for name in SETTINGS:
        with pytest.raises(TypeError) as want:
            check_setting("TrainerConfig", name, bad)
        with pytest.raises(TypeError) as got:
            TrainerConfig(**{name: bad})
        assert str(got.value) == str(want.value), name


def test_a_ppo_name_reads_as_the_schema_setting_it_carries(tmp_path):
    with pytest.raises(ValueError, match=r"PPOConfig.cliprange \(epsilon\) must be a finite float > 0, got -1.0"):
        PPOConfig(output_dir=str(tmp_path), use_cpu=True, cliprange=-1)
    with pytest.raises(ValueError, match=r"GRPOConfig.epsilon must be a finite float > 0, got -1.0"):
        GRPOConfig(output_dir=str(tmp_path), use_cpu=True, epsilon=-1)
    # DPO's beta is the DPO temperature, not the schema's KL weight: its own rule
    with pytest.raises(ValueError, match="beta must be > 0"):
        DPOConfig(output_dir=str(tmp_path), use_cpu=True, beta=0.0)
