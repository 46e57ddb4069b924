"""Vision-language models in GRPOTrainer / RLOOTrainer / DPOTrainer (TRL's `image` / `images` columns with an
`AutoProcessor`) and the facade, on tiny Gemma 3, LLaVA, Qwen2-VL, Qwen2.5-VL and Idefics3 models built in code with
their processors (tests/vlm_models.py): the rollout's log-probs equal the training forward's and the untrained
reference's, they depend on the image, a few steps train every parameter, and bad setups fail at construction."""

import pytest
import torch
from datasets import Dataset

from tests.vlm_models import (
    build_gemma3,
    build_idefics3,
    build_llava,
    build_qwen2_5_vl,
    build_qwen2_vl,
    random_image,
)

FAMILIES = {"gemma3": build_gemma3, "llava": build_llava, "qwen2_vl": build_qwen2_vl, "qwen2_5_vl": build_qwen2_5_vl,
            "idefics3": build_idefics3}
# parameters a family's forward never uses (LLaVA: the CLIP tower's post_layernorm serves its pooled output only)
UNUSED = {"gemma3": (), "llava": ("post_layernorm",), "qwen2_vl": (), "qwen2_5_vl": (), "idefics3": ()}


def _dataset(n: int = 4, column: str = "image") -> Dataset:
    rows = []
    for i in range(n):
        image = random_image(i)
        rows.append({"prompt": [{"role": "user", "content": f"what is {'abcdefgh'[: i + 1]}?"}],  # left padding
                     column: image if column == "image" else [image]})
    return Dataset.from_list(rows)


def _length_reward(completions, **kwargs):
    return [float(len(c[0]["content"])) for c in completions]


def _grpo_args(tmp_path, **overrides):
    from hf_verl import GRPOConfig

    settings = {"output_dir": str(tmp_path), "per_device_train_batch_size": 4, "num_generations": 4,
                "max_completion_length": 6, "max_steps": 2, "learning_rate": 1e-2, "report_to": "none",
                "use_cpu": True, "bf16": False, "beta": 0.1, "logging_steps": 1, "save_strategy": "no",
                "disable_tqdm": True, "seed": 3}
    settings.update(overrides)
    return GRPOConfig(**settings)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_grpo_rollout_logprobs_are_the_training_forwards_and_depend_on_the_image(tmp_path, family):
    from hf_verl import GRPOTrainer
    from hf_verl.data.vision import VISION_INPUTS, tokenize_vision_prompts
    from hf_verl.engine.step import LogProbs
    from hf_verl.engine.vision import computes_own_positions

    model, processor = FAMILIES[family]()
    # Qwen2-VL / Qwen2.5-VL lay out their multimodal RoPE positions themselves (the engine passes none)
    assert computes_own_positions(model) == family.startswith("qwen")
    data = _dataset(column="images")
    trainer = GRPOTrainer(model=model, reward_funcs=_length_reward, args=_grpo_args(tmp_path), train_dataset=data,
                          processing_class=processor)
    rows = [data[0]] * 2 + [data[1]] * 2
    batch = trainer._collect(rows, trainer.engine).batch
    assert len(batch.meta[VISION_INPUTS]) == 4 and "pixel_values" in batch.meta[VISION_INPUTS][0]
    assert len({len(p) for p in batch.meta["prompt_ids"]}) == 2  # left padding in the rollout and the forward
    mask = batch.completion_mask.bool()
    assert int(mask.sum()) > 4
    logp, _ = trainer.actor.logprobs(batch)  # the training forward, padded, with the rows' pixel inputs
    torch.testing.assert_close(logp[mask], batch.sampling_logprobs[mask], atol=1e-5, rtol=0)
    ref = trainer.reference.infer(batch, LogProbs())
    torch.testing.assert_close(ref.logp[mask], logp[mask], atol=1e-5, rtol=0)  # the untrained reference
    other = batch.select(list(range(4)))  # the same tokens, other images
    other.meta[VISION_INPUTS] = tokenize_vision_prompts(
        [dict(r, images=[random_image(50 + i)]) for i, r in enumerate(rows)], processor, None).vision_inputs
    moved, _ = trainer.actor.logprobs(other)
    assert (moved[mask] - logp[mask]).abs().max() > 1e-3


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("trainer_name", ["GRPOTrainer", "RLOOTrainer"])
def test_a_few_steps_train_every_parameter(tmp_path, trainer_name, family):
    import hf_verl

    model, processor = FAMILIES[family]()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    if trainer_name == "GRPOTrainer":
        args = _grpo_args(tmp_path)
    else:
        args = hf_verl.RLOOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                                  max_completion_length=6, max_steps=2, learning_rate=1e-2, report_to="none",
                                  use_cpu=True, bf16=False, beta=0.1, logging_steps=1, save_strategy="no",
                                  disable_tqdm=True, seed=3)
    trainer = getattr(hf_verl, trainer_name)(model=model, reward_funcs=_length_reward, args=args,
                                             train_dataset=_dataset(), processing_class=processor)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)
    unchanged = [n for n, p in model.named_parameters() if torch.equal(p, before[n])]
    assert [n for n in unchanged if not any(u in n for u in UNUSED[family])] == []  # the tower and projector too


def test_image_column_with_a_text_only_model_is_refused(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from hf_verl import GRPOTrainer

    _, processor = build_gemma3()
    tok = processor.tokenizer
    text_model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                              num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(ValueError, match=r"image column\(s\) \['image'\].*text-only"):
        GRPOTrainer(model=text_model, reward_funcs=_length_reward, args=_grpo_args(tmp_path),
                    train_dataset=_dataset(), processing_class=tok)


def test_image_column_with_a_tokenizer_for_processor_is_refused(tmp_path):
    from hf_verl import GRPOTrainer

    model, processor = build_gemma3()
    with pytest.raises(ValueError, match="no image processor.*AutoProcessor"):
        GRPOTrainer(model=model, reward_funcs=_length_reward, args=_grpo_args(tmp_path), train_dataset=_dataset(),
                    processing_class=processor.tokenizer)


@pytest.mark.parametrize("overrides, match", [
    ({"sequence_parallel_size": 2}, "sequence_parallel_size=1"),
    ({"use_vllm": True}, "use_vllm=False"),
    ({"stop": ["!"]}, "stop=None"),
    ({"advantage_estimator": "remax"}, "ReMax"),
])
def test_settings_a_run_on_images_cannot_take_are_refused(tmp_path, overrides, match):
    from hf_verl.trainers.vision_checks import refuse_vision_settings

    class Dims:
        sp = overrides.pop("sequence_parallel_size", 1)

    args = _grpo_args(tmp_path, **overrides)
    with pytest.raises(ValueError, match=match):
        refuse_vision_settings("GRPOTrainer", args, None, Dims())


def test_trl_image_formats_become_image_parts_of_the_first_user_turn():
    from hf_verl.data.vision import prepare_multimodal_messages, row_images

    image = random_image(0)
    assert row_images({"image": image}) == [image] and row_images({"images": []}) is None
    prompt = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what?"}]
    out = prepare_multimodal_messages(prompt, [image])
    assert out[0]["content"] == [{"type": "text", "text": "be brief"}]
    assert out[1]["content"] == [{"type": "image", "image": image}, {"type": "text", "text": "what?"}]
    placed = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"}]}]
    assert prepare_multimodal_messages(placed, [image])[0]["content"][1] == {"type": "image", "image": image}
    with pytest.raises(ValueError, match="no place"):
        prepare_multimodal_messages(placed, [image, image])


def test_a_repeated_row_is_processed_once_and_other_images_are_not_taken_for_it():
    from hf_verl.data.vision import tokenize_vision_prompts

    _, processor = build_gemma3()
    prompt = [{"role": "user", "content": "what?"}]
    rows = [{"prompt": prompt, "image": random_image(0)}, {"prompt": prompt, "image": random_image(0)},
            {"prompt": prompt, "image": random_image(1)}]
    out = tokenize_vision_prompts(rows, processor, None)
    first, again, other = (x["pixel_values"] for x in out.vision_inputs)
    assert again is first  # the group's repeat reuses the processed row
    assert not torch.equal(other, first) and out.ids[2] == out.ids[0]


def test_per_token_fields_sit_under_the_left_padded_prompt():
    from hf_verl.data.vision import collate_vision_inputs

    rows = [{"pixel_values": torch.ones(1, 3, 2, 2), "token_type_ids": torch.tensor([0, 1, 1])},
            {"pixel_values": torch.zeros(1, 3, 2, 2), "token_type_ids": torch.tensor([1, 0])}]
    out = collate_vision_inputs(rows, prompt_width=4, width=6, device="cpu")
    assert out["pixel_values"].shape == (2, 3, 2, 2)
    assert out["token_type_ids"].tolist() == [[0, 0, 1, 1, 0, 0], [0, 0, 1, 0, 0, 0]]
    mixed = collate_vision_inputs([{}, rows[1]], prompt_width=3, width=5, device="cpu", right_padded=True)
    assert mixed["pixel_values"].shape == (1, 3, 2, 2)  # a text-only row adds no image
    assert mixed["token_type_ids"].tolist() == [[0, 0, 0, 0, 0], [1, 0, 0, 0, 0]]
    # Idefics3 keeps a row's images on dim 1: a one-image row beside a two-image row gets an all-zero second image
    rows = [{"pixel_values": torch.ones(1, 1, 3, 2, 2)}, {"pixel_values": torch.ones(1, 2, 3, 2, 2)}]
    idefics = collate_vision_inputs(rows, prompt_width=1, width=1, device="cpu")
    assert idefics["pixel_values"].shape == (2, 2, 3, 2, 2)
    assert idefics["pixel_values"][0, 1].abs().sum() == 0 and idefics["pixel_values"][1].abs().min() == 1


@pytest.mark.multiprocess
@pytest.mark.slow
def test_ddp_on_two_processes_equals_one_process(tmp_path):
    """GRPO with image prompts on 2 gloo processes (per-device batch 2) ends on the weights of one process
    (per-device batch 4): the same global rounds, completions (per-row seeds) and averaged gradients."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.distributed.vlm_dp import run

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29571",
           "-m", "tests.distributed.vlm_dp", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    two = json.loads((tmp_path / "rank0.json").read_text())
    assert two["world"] == 2 and "MULTI_CPU" in two["distributed_type"]
    one = run(str(tmp_path / "one"), per_device_batch=4)
    assert two["rewards"] == pytest.approx(one["rewards"], abs=1e-6)  # the same completions
    assert two["losses"] == pytest.approx(one["losses"], abs=1e-5)
    state = torch.load(tmp_path / "state.pt")
    moved = max((one["state"][n] - build).abs().max().item() for n, build in _initial_state().items())
    assert moved > 1e-3  # the runs trained
    for name, value in one["state"].items():
        # a key bias gets no gradient but rounding (softmax ignores a shift of its logits), which Adam scales up to
        # steps of the learning rate's size: measured 2.4e-5 apart; every other weight within 1.4e-5, most 1e-6
        tolerance = 1e-4 if name.endswith("k_proj.bias") else 3e-5
        torch.testing.assert_close(state[name], value, atol=tolerance, rtol=0, msg=name)


def _initial_state():
    model, _ = build_gemma3()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _pairs(n: int = 4) -> Dataset:
    rows = []
    for i in range(n):
        rows.append({"prompt": [{"role": "user", "content": f"what is {'abcdefgh'[i]}?"}],
                     "chosen": [{"role": "assistant", "content": "a cat"}],
                     "rejected": [{"role": "assistant", "content": "no idea"}], "images": [random_image(i)]})
    return Dataset.from_list(rows)


def _dpo_args(tmp_path, **overrides):
    from hf_verl import DPOConfig

    settings = {"output_dir": str(tmp_path), "per_device_train_batch_size": 2, "max_steps": 3, "learning_rate": 1e-2,
                "report_to": "none", "use_cpu": True, "bf16": False, "logging_steps": 1, "save_strategy": "no",
                "disable_tqdm": True, "gradient_checkpointing": False, "max_length": 64, "seed": 3}
    settings.update(overrides)
    return DPOConfig(**settings)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_dpo_on_image_pairs_trains_and_its_logprobs_depend_on_the_image(tmp_path, family):
    from hf_verl import DPOTrainer
    from hf_verl.data.vision import (
        VISION_INPUTS,
        collate_vision_inputs,
        tokenize_vision_prompts,
    )

    model, processor = FAMILIES[family]()
    data = _pairs()
    trainer = DPOTrainer(model=model, args=_dpo_args(tmp_path), train_dataset=data, processing_class=processor)
    batch = trainer._collate([trainer.train_dataset[i] for i in range(2)])
    assert len(batch[VISION_INPUTS]) == 4  # chosen rows, then rejected rows
    logps = trainer._sequence_logps(trainer.actor, batch)[0]
    # the chosen answer's summed log-prob by hand: one forward of the model on the first chosen row alone
    row = batch["attention_mask"][0].bool()
    ids = batch["input_ids"][0][row][None]
    inputs = collate_vision_inputs(batch[VISION_INPUTS][:1], prompt_width=0, width=ids.shape[1], device="cpu",
                                   right_padded=True)
    with torch.no_grad():
        logits = model(input_ids=ids, **inputs).logits[0, :-1].float()
    comp = batch["completion_mask"][0][row][1:].bool()
    by_hand = logits.log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0][comp].sum()
    torch.testing.assert_close(logps[0].detach(), by_hand, atol=1e-5, rtol=0)
    other = dict(batch)
    swapped = tokenize_vision_prompts([dict(trainer.train_dataset[i], images=[random_image(60 + i)])
                                       for i in range(2)], processor, None).vision_inputs
    other[VISION_INPUTS] = swapped + swapped
    assert (trainer._sequence_logps(trainer.actor, other)[0] - logps).abs().max() > 1e-3
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 3 and logs[-1]["loss"] < logs[0]["loss"]  # the preference is learned
    unchanged = [n for n, p in model.named_parameters() if torch.equal(p, before[n])]
    assert [n for n in unchanged if not any(u in n for u in UNUSED[family])] == []


def test_dpo_refuses_images_with_a_text_only_model_and_padding_free(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from hf_verl import DPOTrainer

    model, processor = build_gemma3()
    with pytest.raises(ValueError, match="padding_free=False"):
        DPOTrainer(model=model, args=_dpo_args(tmp_path, padding_free=True), train_dataset=_pairs(),
                   processing_class=processor)
    with pytest.raises(ValueError, match="precompute_ref_log_probs.*not supported for vision datasets"):  # TRL's
        DPOTrainer(model=model, args=_dpo_args(tmp_path, precompute_ref_log_probs=True), train_dataset=_pairs(),
                   processing_class=processor)
    with pytest.warns(FutureWarning, match="keep_end.*deprecated"):  # TRL 1.16's deprecation
        keep_end = _dpo_args(tmp_path, truncation_mode="keep_end")
    with pytest.raises(ValueError, match="truncation_mode='keep_end' is not supported for vision-language models"):
        DPOTrainer(model=model, args=keep_end, train_dataset=_pairs(), processing_class=processor)
    tok = processor.tokenizer
    text_model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                              num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(ValueError, match="vision-related.*text-only.*vision-language model"):  # TRL's words too
        DPOTrainer(model=text_model, args=_dpo_args(tmp_path), train_dataset=_pairs(), processing_class=tok)


def test_dpo_drops_image_pairs_whose_prompt_fills_max_length(tmp_path):
    """As TRL: a pair whose prompt (image tokens included) alone fills `max_length` is dropped, never cut; the
    others keep their whole prompt and lose their answers' ends."""
    from hf_verl import DPOTrainer

    model, processor = build_gemma3()
    data = _pairs(2)
    rows = [dict(data[0]), dict(data[1], prompt=[{"role": "user", "content": "what is a, and b, c, d, e, f and g?"}])]
    short = DPOTrainer(model=model, args=_dpo_args(tmp_path, max_length=None), train_dataset=data,
                       processing_class=processor).train_dataset[0]
    cut = len(short["prompt_ids"]) + 2
    trainer = DPOTrainer(model=model, args=_dpo_args(tmp_path, max_length=cut),
                         train_dataset=Dataset.from_list(rows), processing_class=processor)
    kept = trainer.train_dataset
    assert len(kept) == 1 and kept[0]["prompt_ids"] == short["prompt_ids"]
    assert kept[0]["chosen_ids"] == short["chosen_ids"][:2] and kept[0]["rejected_ids"] == short["rejected_ids"][:2]
    with pytest.raises(ValueError, match="every train pair's prompt alone fills max_length=4"):
        DPOTrainer(model=model, args=_dpo_args(tmp_path, max_length=4), train_dataset=data, processing_class=processor)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_facade_trains_on_image_rows_with_the_processor_as_tokenizer(family):
    from hf_verl import Trainer

    model, processor = FAMILIES[family]()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    config = {"group_size": 4, "max_new_tokens": 5, "actor_lr": 1e-2, "seed": 0, "use_async_rollout": False,
              "beta": 0.1}
    trainer = Trainer(actor_model=model, reference_model=FAMILIES[family]()[0], reward_model=_length_reward,
                      tokenizer=processor, config=config)
    rows = [{"prompt": [{"role": "user", "content": "what is a?"}], "image": random_image(0)}]
    for _ in range(2):
        rollout = trainer.rollout(rows)
        mask = rollout.completion_mask.bool()
        torch.testing.assert_close(rollout.old_logprobs[mask], rollout.sampling_logprobs[mask], atol=1e-5, rtol=0)
        trainer.step(trainer.compute_loss(rollout))
    unchanged = [n for n, p in model.named_parameters() if torch.equal(p, before[n])]
    assert [n for n in unchanged if not any(u in n for u in UNUSED[family])] == []
    text_only = Trainer(actor_model=model, reward_model=_length_reward, tokenizer=processor.tokenizer, config=config)
    with pytest.raises(ValueError, match="no image processor"):
        text_only.rollout(rows)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_text_only_rows_beside_image_rows(tmp_path, family):
    """TRL's mixed datasets (an `images` list empty on some rows, longer on others): a text-only row adds no
    pixels, a row of two images adds both (Idefics3 pads its one-image rows with an empty image), and the
    log-probs are still the rollout's."""
    from hf_verl import GRPOTrainer
    from hf_verl.data.vision import VISION_INPUTS

    model, processor = FAMILIES[family]()
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": "what is a?"}], "images": []},
                              {"prompt": [{"role": "user", "content": "what is b?"}], "images": [random_image(1)]},
                              {"prompt": [{"role": "user", "content": "and c?"}],
                               "images": [random_image(2), random_image(3)]}])
    trainer = GRPOTrainer(model=model, reward_funcs=_length_reward, args=_grpo_args(tmp_path), train_dataset=data,
                          processing_class=processor)
    batch = trainer._collect([data[0], data[0], data[1], data[2]], trainer.engine).batch
    assert "pixel_values" not in batch.meta[VISION_INPUTS][0] and "pixel_values" in batch.meta[VISION_INPUTS][2]
    mask = batch.completion_mask.bool()
    logp, _ = trainer.actor.logprobs(batch)
    torch.testing.assert_close(logp[mask], batch.sampling_logprobs[mask], atol=1e-5, rtol=0)
    text_round = trainer._collect([data[0]] * 4, trainer.engine).batch  # no image in the round: the text path,
    assert VISION_INPUTS not in text_round.meta  # rendered with the processor's chat template
    assert text_round.meta["prompt_ids"][0] == batch.meta["prompt_ids"][0]


def test_grpo_with_a_peft_adapter_on_a_vlm(tmp_path):
    """TRL's `test_train_vlm_peft`: LoRA on the text model's attention, the reference = adapters disabled."""
    from peft import LoraConfig

    from hf_verl import GRPOTrainer

    model, processor = build_gemma3()
    trainer = GRPOTrainer(model=model, reward_funcs=_length_reward, args=_grpo_args(tmp_path), train_dataset=_dataset(),
                          processing_class=processor, peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}
    frozen = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" not in n}
    trainer.train()
    after = dict(trainer.model.named_parameters())
    assert before and all(not torch.equal(after[n], p) for n, p in before.items())
    assert all(torch.equal(after[n], p) for n, p in frozen.items())
    kls = [h["kl"] for h in trainer.state.log_history if "kl" in h]
    assert kls[0] == 0.0 and kls[-1] > 0.0  # the policy moved away from the adapters-off reference
