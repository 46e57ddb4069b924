"""GRPOConfig: TRL's defaults and the validation messages."""

import pytest

from hf_verl.trainers.grpo_config import GRPOConfig


def _cfg(tmp_path, **kw):
    kw.setdefault("per_device_train_batch_size", 8)
    return GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], **kw)


def test_trl_defaults(tmp_path):
    c = _cfg(tmp_path)
    assert (c.learning_rate, c.num_generations, c.loss_type, c.scale_rewards) == (1e-6, 8, "dapo", "group")
    assert c.beta == 0.0 and c.epsilon == 0.2 and c.gradient_checkpointing and not c.bf16
    assert c.generation_batch_size == 8 and c.steps_per_generation == 1


def test_generation_batch_resolution(tmp_path):
    c = _cfg(tmp_path, per_device_train_batch_size=4, num_generations=4, steps_per_generation=3)
    assert c.generation_batch_size == 12
    c = _cfg(tmp_path, per_device_train_batch_size=4, num_generations=4, generation_batch_size=16)
    assert c.steps_per_generation == 4
    assert _cfg(tmp_path, scale_rewards=False).scale_rewards == "none"


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"num_generations": 1}, "num_generations must be >= 2"),
        ({"num_generations": 3}, "not divisible by num_generations=3"),
        ({"loss_type": "ppo"}, r"GRPOConfig.loss_type must be one of .* got 'ppo'"),
        ({"scale_rewards": "always"}, "scale_rewards must be one of"),
        ({"generation_batch_size": 12}, "must be a multiple of"),
        ({"use_vllm": True, "vllm_mode": "remote"}, "vllm_mode must be .server. or .colocate."),
        ({"vllm_importance_sampling_mode": "x"}, "vllm_importance_sampling_mode must be one of"),
        ({"beta": -0.1}, r"GRPOConfig.beta must be a finite float >= 0, got -0.1"),
        ({"top_p": 0.0}, r"GRPOConfig.top_p must be a float in \(0, 1\]"),
        ({"max_completion_length": 0}, r"GRPOConfig.max_completion_length must be an int >= 1"),
        ({"dual_clip": 0.5}, r"GRPOConfig.dual_clip must be None or a finite float > 1"),
    ],
)
def test_bad_configs_say_what_to_change(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        _cfg(tmp_path, **kw)


def test_colocated_vllm_length_comes_from_the_model_or_fails_naming_the_field():
    from types import SimpleNamespace

    from hf_verl.rollout.vllm_engine import colocate_max_model_len

    model = SimpleNamespace(max_position_embeddings=256)
    args = SimpleNamespace(vllm_max_model_length=None, max_prompt_length=64)
    assert colocate_max_model_len(args, model, 32) == 96  # fits: prompt + completion
    args.max_prompt_length = 512  # GRPOConfig's default: more than the model has
    assert colocate_max_model_len(args, model, 8) == 256
    with pytest.raises(ValueError, match="leaves no room for a prompt.*lower max_completion_length"):
        colocate_max_model_len(args, model, 256)
    args.vllm_max_model_length = 300
    with pytest.raises(ValueError, match=r"vllm_max_model_length=300 exceeds the model's 256 positions"):
        colocate_max_model_len(args, model, 8)
    args.vllm_max_model_length = 200
    assert colocate_max_model_len(args, model, 8) == 200


@pytest.mark.parametrize("loss_type, warned", [("grpo", False), ("dapo", True), ("bnpo", True)])
def test_sequence_level_ratios_with_a_token_summed_loss_are_warned(tmp_path, caplog, loss_type, warned):
    with caplog.at_level("WARNING"):
        GRPOConfig(output_dir=str(tmp_path), report_to="none", importance_sampling_level="sequence",
                   loss_type=loss_type)
    assert ("weights each sequence by its completion length" in caplog.text) == warned  # TRL's warning


def test_the_schema_is_checked_as_the_facade_checks_it(tmp_path):
    """One mechanism: a value the facade's TrainerConfig refuses is refused by GRPOConfig / PPOConfig with the same
    words, and a value it accepts is accepted (an int widened to a float)."""
    from hf_verl import PPOConfig
    from hf_verl.facade.config import TrainerConfig

    with pytest.raises(ValueError) as facade:
        TrainerConfig(top_entropy_quantile=1.5)
    with pytest.raises(ValueError) as trainer:
        _cfg(tmp_path, top_entropy_quantile=1.5)
    assert str(facade.value).split(".", 1)[1] == str(trainer.value).split(".", 1)[1]
    assert "must be a float in [0, 1], got 1.5" in str(trainer.value)
    with pytest.raises(ValueError, match=r"PPOConfig.gamma must be a float in \[0, 1\], got 1.5"):
        PPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], gamma=1.5)
    with pytest.raises(TypeError, match=r"GRPOConfig.stop must be None or a list of strings, got str"):
        _cfg(tmp_path, stop="</answer>")
    c = _cfg(tmp_path, temperature=1, generation_kwargs={"top_k": 5})
    assert isinstance(c.temperature, float) and TrainerConfig(generation_kwargs={"top_k": 5}).generation_kwargs == {"top_k": 5}
