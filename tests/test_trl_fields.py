"""Walk TRL's GRPOConfig, DPOConfig and RewardConfig field lists: every field exists in ours with TRL's default, and
is either read by the library (outside the line that declares it) or refused with a message when set. A new TRL
field, a changed default or a field that is accepted and ignored fails here."""

import dataclasses
import pathlib
import re

import pytest

trl = pytest.importorskip("trl")

from transformers import TrainingArguments  # noqa: E402

from hf_verl import DPOConfig, GRPOConfig, RewardConfig  # noqa: E402

BASE = {f.name for f in dataclasses.fields(TrainingArguments)}
# where hf_verl's default differs from TRL's on purpose (documented in docs/coming_from_trl.md)
DEPARTURES = {"bf16": "None: on only where bf16-capable CUDA is visible (TRL turns it on everywhere)"}
# values TRL accepts and hf_verl refuses, each with the reason in its error message
REFUSED = {
    GRPOConfig: {
        "vllm_group_port": (51217, "HTTP"),
        "log_completions_hub_repo": ("me/completions", "completions"),
        "use_transformers_continuous_batching": (True, "use_vllm"),
        "use_transformers_paged": (True, "use_vllm"),
        "transformers_continuous_batching_config": ({"max_batch_tokens": 8}, "not support"),
    },
    DPOConfig: {},
    RewardConfig: {},
}
# read in TRL only for inputs hf_verl refuses (images): refusing those inputs is tested in test_grpo_options
INPUT_ONLY = {"log_multimodal"}


def _trl_fields(cls):
    return [f for f in dataclasses.fields(cls) if f.name not in BASE]


def _default(f):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _source_without_declarations() -> str:
    """The library's source with the lines declaring config fields removed."""
    lines = []
    for path in pathlib.Path(__file__).parents[1].joinpath("hf_verl").rglob("*.py"):
        for line in path.read_text().splitlines():
            if re.match(r"\s+\w+: .*= field\(", line):
                continue
            lines.append(line)
    return "\n".join(lines)


PAIRS = [(trl.GRPOConfig, GRPOConfig), (trl.DPOConfig, DPOConfig), (trl.RewardConfig, RewardConfig)]
PAIR_IDS = ["GRPOConfig", "DPOConfig", "RewardConfig"]


@pytest.mark.parametrize("theirs,ours", PAIRS, ids=PAIR_IDS)
def test_every_trl_field_exists_with_trls_default(theirs, ours):
    mine = {f.name: f for f in dataclasses.fields(ours)}
    missing = [f.name for f in _trl_fields(theirs) if f.name not in mine]
    assert not missing, f"{ours.__name__} lacks TRL fields {missing}"
    wrong = {f.name: (_default(f), _default(mine[f.name])) for f in _trl_fields(theirs)
             if f.name not in DEPARTURES and _default(f) != _default(mine[f.name])}
    assert not wrong, f"defaults differing from TRL's (theirs, ours): {wrong}"


@pytest.mark.parametrize("theirs,ours", PAIRS, ids=PAIR_IDS)
def test_every_trl_field_is_read_or_refused(theirs, ours):
    source = _source_without_declarations()
    unused = [f.name for f in _trl_fields(theirs)
              if f.name not in REFUSED[ours] and f.name not in INPUT_ONLY
              and not re.search(rf"(\.{f.name}\b|[\"']{f.name}[\"'])", source)]
    assert not unused, f"TRL fields accepted but never read: {unused}"


@pytest.mark.parametrize("cls,name", [(c, n) for c, names in REFUSED.items() for n in names],
                         ids=lambda x: x if isinstance(x, str) else x.__name__)
def test_refused_fields_say_why(tmp_path, cls, name):
    value, reason = REFUSED[cls][name]
    with pytest.raises(ValueError, match=reason):
        cls(output_dir=str(tmp_path), **{name: value})


@pytest.mark.parametrize("name", ["GRPOConfig", "PPOConfig", "DPOConfig", "RewardConfig"])
def test_output_dir_is_the_first_positional_field(name):
    """TRL's trainers (and users) build `XConfig("<model>-XX")`: output_dir must stay the first field, ahead of any
    field a mixin adds (a mixin placed before TrainingArguments' fields once took the name as `backend`)."""
    import dataclasses

    import hf_verl

    cls = getattr(hf_verl, name)
    assert dataclasses.fields(cls)[0].name == "output_dir"
    assert cls("some-model-XX").output_dir == "some-model-XX"
