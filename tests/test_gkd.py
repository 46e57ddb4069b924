"""GKDTrainer / GKDConfig: the generalized JSD against hand math, the sampled-token loss's value and gradient, on- vs
off-policy rows, training toward a fixed teacher, the cross-tokenizer and served teachers' log-probs, and the
errors at construction."""

import math

import pytest
import torch
from datasets import Dataset

from hf_verl import GKDConfig, GKDTrainer
from hf_verl.algorithms.distillation import (
    generalized_jsd,
    generalized_jsd_loss,
    sampled_token_distillation_loss,
)
from hf_verl.engine.step import LogProbs
from tests.conftest import CHAT_TEMPLATE, build_bpe_tokenizer, build_char_tokenizer
from tests.test_facade import tiny_llama


def _kl(p, q):
    return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q) if pi > 0)


def _softmax(xs):
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    return [v / sum(e) for v in e]


# ---------------------------------------------------------------------- the losses, by hand
@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
def test_generalized_jsd_equals_the_hand_computation(beta):
    student, teacher = [0.2, -1.0, 1.5], [1.0, 0.1, -0.4]
    for temperature in (1.0, 2.0):
        p_s = _softmax([x / temperature for x in student])
        p_t = _softmax([x / temperature for x in teacher])
        if beta == 0:
            expected = _kl(p_t, p_s)
        elif beta == 1:
            expected = _kl(p_s, p_t)
        else:
            m = [beta * t + (1 - beta) * s for s, t in zip(p_s, p_t)]
            expected = beta * _kl(p_t, m) + (1 - beta) * _kl(p_s, m)
        got = generalized_jsd(torch.tensor([student]), torch.tensor([teacher]), beta=beta,
                              temperature=temperature).sum().item()
        assert got == pytest.approx(expected, abs=1e-6)


def test_generalized_jsd_loss_counts_labelled_positions_and_normalises_like_trl():
    torch.manual_seed(0)
    s, t = torch.randn(2, 3, 5), torch.randn(2, 3, 5)
    labels = torch.tensor([[-100, 1, 2], [-100, -100, 4]])
    per_pos = generalized_jsd(s, t, beta=0.5).sum(-1)
    counted = per_pos[labels != -100]
    assert generalized_jsd_loss(s, t, labels).item() == pytest.approx(counted.sum().item() / 3, rel=1e-6)
    assert generalized_jsd_loss(s, t, labels, num_items_in_batch=6).item() == pytest.approx(
        counted.sum().item() / 6, rel=1e-6)
    assert generalized_jsd_loss(s, s).item() == pytest.approx(0.0, abs=1e-7)
    with pytest.raises(ValueError, match="one vocabulary"):
        generalized_jsd(torch.randn(1, 4), torch.randn(1, 5))


def test_sampled_token_loss_value_and_gradient():
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    teacher = torch.tensor([[-1.5, -1.0, -0.5]])
    mask = torch.tensor([[1, 1, 0]])
    loss, kl = sampled_token_distillation_loss(logp, teacher, mask, on_policy=True)
    assert kl.item() == pytest.approx((-1.0 + 1.5) + (-2.0 + 1.0))  # sum of log p_S - log p_T on counted tokens
    loss.backward()
    # d/d logp of sg(log p_S - log p_T) * log p_S: the log-ratio itself (the score-function weight)
    assert logp.grad.tolist() == [[0.5, -1.0, 0.0]]
    logp.grad = None
    nll, _ = sampled_token_distillation_loss(logp, teacher, mask, on_policy=False)
    assert nll.item() == pytest.approx(3.0)
    nll.backward()
    assert logp.grad.tolist() == [[-1.0, -1.0, 0.0]]


# ---------------------------------------------------------------------- trainers on tiny models
def _rows(n=16):
    return Dataset.from_list([{"messages": [{"role": "user", "content": f"reverse ab{c}"},
                                            {"role": "assistant", "content": f"{c}ba"}]}
                              for c in "cdefghijklmnopqrstuvwxyz"[:n]])


def _config(tmp_path, **kw):
    base = {"output_dir": str(tmp_path), "per_device_train_batch_size": 4, "max_new_tokens": 6, "report_to": "none",
            "save_strategy": "no", "logging_steps": 1, "gradient_checkpointing": False, "learning_rate": 3e-3,
            "seed": 0}
    return GKDConfig(**{**base, **kw})


def _trainer(tmp_path, student_tok, teacher_tok=None, teacher_seed=1, **kw):
    teacher_tok = teacher_tok or student_tok
    return GKDTrainer(model=tiny_llama(student_tok, seed=0), teacher_model=tiny_llama(teacher_tok, seed=teacher_seed),
                      args=_config(tmp_path, **kw), train_dataset=_rows(), eval_dataset=_rows(8),
                      processing_class=student_tok,
                      teacher_processing_class=None if teacher_tok is student_tok else teacher_tok)


def test_lmbda_one_samples_on_policy_and_lmbda_zero_uses_the_dataset_completion(tmp_path):
    tok = build_char_tokenizer()
    for lmbda in (1.0, 0.0):
        trainer = _trainer(tmp_path, tok, lmbda=lmbda)
        inputs = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
        batch, on_policy = trainer._rollout(inputs)
        prompts = [tok.decode(p[m.bool()]) for p, m in zip(batch.prompt_ids, batch.prompt_mask)]
        assert prompts == [tok.apply_chat_template(r["messages"][:1], add_generation_prompt=True, tokenize=False)
                           for r in trainer.train_dataset.select(range(4))]
        completions = [tok.decode(c[m.bool()]) for c, m in zip(batch.completion_ids, batch.completion_mask)]
        if lmbda == 1.0:
            assert on_policy and trainer.generator.__class__.__name__ == "TransformersEngine"
            assert all(1 <= n <= 6 for n in batch.completion_mask.sum(-1).tolist())  # max_new_tokens=6
            assert completions != ["cba\n", "dba\n", "eba\n", "fba\n"]  # a random student does not write these
        else:
            assert not on_policy
            assert completions == ["cba\n", "dba\n", "eba\n", "fba\n"]


@pytest.mark.slow
def test_gkd_steps_move_every_weight_and_lower_the_jsd_toward_a_fixed_teacher(tmp_path):
    tok = build_char_tokenizer()
    trainer = _trainer(tmp_path, tok, lmbda=0.0, beta=0.5, max_steps=25)
    eval_batch = trainer.data_collator([trainer.eval_dataset[i] for i in range(8)])
    before_weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    teacher_before = {n: p.detach().clone() for n, p in trainer.teacher_model.named_parameters()}
    with torch.no_grad():
        before = trainer.compute_loss(trainer.model, eval_batch).item()
    trainer.train()
    with torch.no_grad():
        after = trainer.compute_loss(trainer.model, eval_batch).item()
    assert after < 0.5 * before, (before, after)
    for n, p in trainer.model.named_parameters():
        assert not torch.equal(p, before_weights[n]), f"{n} did not move"
    for n, p in trainer.teacher_model.named_parameters():
        assert torch.equal(p, teacher_before[n]), f"the teacher's {n} moved"
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 25 and all(math.isfinite(h["loss"]) for h in logged)
    # the loss a step logs is TRL's batchmean JSD of the micro-batch it trained on (its first step: weights unchanged)
    assert logged[-1]["loss"] < logged[0]["loss"]


def _permuted_char_tokenizer():
    """The char tokenizer's characters with other ids (same text pieces, another vocabulary)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<user>", "<assistant>", "<system>"]
    chars = list(reversed("abcdefghijklmnopqrstuvwxyz0123456789 .,?!:=+-\n"))
    tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(specials + chars)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")
    fast.add_special_tokens({"additional_special_tokens": specials[2:]})
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _teacher_own_logprobs(model, tok, prompt: str, completion: str, eos: bool):
    """The teacher's own forward on its tokens of prompt + completion (+ its EOS): the completion tokens' log-probs."""
    p_ids, c_ids = tok(prompt)["input_ids"], tok(completion)["input_ids"] + ([tok.eos_token_id] if eos else [])
    ids = torch.tensor([p_ids + c_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
    return logp.gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)[len(p_ids) - 1:]


@pytest.mark.slow
def test_cross_tokenizer_teacher_log_probs_equal_the_teachers_own_forward(tmp_path):
    student_tok = build_char_tokenizer()
    for teacher_tok in (_permuted_char_tokenizer(), build_bpe_tokenizer()):
        trainer = _trainer(tmp_path, student_tok, teacher_tok, lmbda=1.0)
        assert trainer.algorithm.mode == "cross_tokenizer"
        inputs = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
        batch = trainer._dataset_batch(inputs)
        aligned = trainer.algorithm.teacher_side(batch, trainer.actor)
        special = set(student_tok.all_special_ids)
        for row in range(4):
            cols = batch.completion_mask[row].bool()
            p_ids = batch.prompt_ids[row][batch.prompt_mask[row].bool()].tolist()
            c_ids = batch.completion_ids[row][cols].tolist()
            prompt = student_tok.decode(p_ids)
            completion = student_tok.decode([t for t in c_ids if t not in special])
            own = _teacher_own_logprobs(trainer.teacher_model, teacher_tok, prompt, completion,
                                        eos=student_tok.eos_token_id in c_ids)
            if teacher_tok.get_vocab().keys() == student_tok.get_vocab().keys():  # one teacher token per student one
                torch.testing.assert_close(aligned[row][cols], own, rtol=1e-5, atol=1e-5)
            else:  # segments of several characters: the completion's total is the teacher's own
                assert aligned[row][cols].sum().item() == pytest.approx(own.sum().item(), abs=1e-4)
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.args.max_steps = 2
        trainer.train()
        assert all(math.isfinite(h["loss"]) for h in trainer.state.log_history if "loss" in h)
        assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())


def test_a_served_teacher_scores_the_students_tokens_like_the_local_one(tmp_path):
    from hf_verl.rollout.hf_engine import TransformersEngine
    from hf_verl.serve.server import RolloutServer

    tok = build_char_tokenizer()
    teacher = tiny_llama(tok, seed=1).eval()
    server = RolloutServer(TransformersEngine(teacher, tok), tok, "teacher", port=0).start()
    try:
        trainer = GKDTrainer(model=tiny_llama(tok, seed=0), args=_config(
            tmp_path, lmbda=1.0, max_steps=2, placement={"teacher": server.address}),
            train_dataset=_rows(), processing_class=tok)
        assert trainer.algorithm.mode == "sampled" and trainer.teacher_model is None
        batch = trainer._dataset_batch(trainer.data_collator([trainer.train_dataset[i] for i in range(4)]))
        served = trainer.algorithm.teacher_side(batch, trainer.actor)
        from hf_verl.engine.registry import make_engine

        local_engine = make_engine(teacher, "teacher", trainer.layout, trainable=False)
        expected = local_engine.infer(batch, LogProbs()).logp
        torch.testing.assert_close(served, expected, rtol=1e-4, atol=1e-4)
        trainer.train()
        assert all(math.isfinite(h["loss"]) for h in trainer.state.log_history if "loss" in h)
    finally:
        server.shutdown()


# ---------------------------------------------------------------------- errors at construction
def test_bad_inputs_are_refused_with_what_to_change(tmp_path):
    tok, bpe = build_char_tokenizer(), build_bpe_tokenizer()
    with pytest.raises(ValueError, match="lmbda must be in the range"):
        GKDConfig(output_dir=str(tmp_path), lmbda=1.5)
    with pytest.raises(ValueError, match="beta must be in the range"):
        GKDConfig(output_dir=str(tmp_path), beta=-0.1)
    with pytest.raises(ValueError, match="teacher_processing_class"):  # another vocabulary, no tokenizer for it
        GKDTrainer(model=tiny_llama(tok), teacher_model=tiny_llama(bpe), args=_config(tmp_path),
                   train_dataset=_rows(), processing_class=tok)
    with pytest.raises(ValueError, match="seq_kd=True"):
        _trainer(tmp_path, tok, bpe, seq_kd=True)
    with pytest.raises(ValueError, match="already instantiated"):
        GKDTrainer(model=tiny_llama(tok), teacher_model=tiny_llama(tok),
                   args=_config(tmp_path, teacher_model_init_kwargs={"dtype": "float32"}),
                   train_dataset=_rows(), processing_class=tok)
    with pytest.raises(ValueError, match="needs a teacher"):
        GKDTrainer(model=tiny_llama(tok), args=_config(tmp_path), train_dataset=_rows(), processing_class=tok)
    # a teacher tokenizer without the run's characters (a digits-only vocabulary) cannot round-trip its text
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    narrow = Tokenizer(models.WordLevel(vocab={"<pad>": 0, "<eos>": 1, **{d: i + 2 for i, d in enumerate("0123")}},
                                        unk_token="<pad>"))
    narrow.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    narrow.decoder = decoders.Fuse()
    narrow = PreTrainedTokenizerFast(tokenizer_object=narrow, eos_token="<eos>", pad_token="<pad>")
    with pytest.raises(ValueError, match="cannot round-trip"):
        _trainer(tmp_path, tok, narrow)


def test_across_tokenizers_eos_is_the_teachers_eos_and_textless_tokens_end_the_scored_completion(tmp_path):
    from hf_verl.data.batch import RolloutBatch, pad_sequences
    from hf_verl.pipeline.distillation import UNSCORABLE_LOGPROB

    student_tok, teacher_tok = build_char_tokenizer(), _permuted_char_tokenizer()
    trainer = _trainer(tmp_path, student_tok, teacher_tok, lmbda=1.0)
    prompt = "<user>reverse abc\n<assistant>"
    p_ids = student_tok(prompt)["input_ids"]
    eos, pad = student_tok.eos_token_id, student_tok.pad_token_id
    completions = [student_tok("cba")["input_ids"] + [eos], student_tok("c")["input_ids"] + [pad] +
                   student_tok("ba")["input_ids"] + [eos]]
    prompts, p_mask = pad_sequences([p_ids, p_ids], pad, side="left")
    c_ids, c_mask = pad_sequences(completions, pad, side="right")
    c_mask[1, 1] = 1  # the generated <pad> is a real completion token
    mb = trainer.algorithm.prepare(RolloutBatch(prompts, p_mask, c_ids, c_mask), trainer.actor, on_policy=True)
    own = _teacher_own_logprobs(trainer.teacher_model, teacher_tok, prompt, "cba", eos=True)
    torch.testing.assert_close(mb.teacher[0, :4], own, rtol=1e-5, atol=1e-5)  # EOS included, token for token
    assert mb.batch.completion_mask[1].tolist() == [1, 1, 0, 0, 0]  # scored up to the <pad>, not after it
    assert mb.teacher[1, 1].item() == UNSCORABLE_LOGPROB
    assert mb.teacher[1, 0].item() == pytest.approx(own[0].item(), abs=1e-5)


def test_every_field_of_trls_gkd_config_is_here_with_its_default():
    import dataclasses

    trl_gkd = pytest.importorskip("trl.experimental.gkd")
    from transformers import TrainingArguments

    base = {f.name: f for f in dataclasses.fields(TrainingArguments)}
    ours = {f.name: f for f in dataclasses.fields(GKDConfig)}

    def default(f):
        return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default

    for f in dataclasses.fields(trl_gkd.GKDConfig):
        if f.name in base and default(f) == default(base[f.name]):
            continue
        assert f.name in ours, f"GKDConfig lacks TRL's field {f.name}"
        if f.name != "bf16":  # hf_verl's one departure: None turns on only on bf16-capable CUDA
            assert default(ours[f.name]) == default(f), (f.name, default(ours[f.name]), default(f))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_ddp_student_with_an_fsdp2_teacher_over_two_processes_equals_one_process(tmp_path):
    """The same global batch (4 rows, lmbda=0) on one process and on 2 gloo processes (a DDP student, the teacher
    sharded by its own placement, FSDP2): the same logged losses and trained weights; then an on-policy step runs."""
    from safetensors.torch import load_file

    from tests.one_and_two import one_and_two

    want, got, one, two = one_and_two("tests.distributed.gkd_dp", "ddp_cpu", tmp_path)
    assert (want["world"], want["backend"], want["teacher_backend"]) == (1, "plain", "plain")
    assert (got["world"], got["dp_size"], got["backend"]) == (2, 2, "ddp")
    assert (got["teacher_backend"], got["teacher_param_type"]) == ("fsdp2", "DTensor")
    assert len(got["losses"]) == 4 and got["losses"] == pytest.approx(want["losses"], rel=1e-4)
    assert want["losses"][-1] < 0.5 * want["losses"][0]
    a, b = (load_file(str(d / "final" / "model.safetensors")) for d in (one, two))
    assert set(a) == set(b) and max((a[k] - b[k]).abs().max().item() for k in a) < 2e-5
    assert len(got["on_policy_loss"]) == 1 and math.isfinite(got["on_policy_loss"][0])


def test_seq_kd_trains_on_the_teachers_own_completions(tmp_path):
    tok = build_char_tokenizer()
    trainer = _trainer(tmp_path, tok, lmbda=0.0, seq_kd=True, max_steps=2)
    assert trainer._teacher_generator.model is trainer.teacher_model
    inputs = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    torch.manual_seed(0)
    batch, on_policy = trainer._rollout(inputs)
    assert not on_policy and batch.completion_mask.sum(-1).max().item() <= 6
    # the teacher sampled them: under the teacher they are likelier than the dataset's completions are per token
    teacher_side = trainer.algorithm.teacher_side(batch, trainer.actor)  # (B, C, V) logits
    logp = torch.log_softmax(teacher_side, -1).gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)
    sampled = (logp * batch.completion_mask).sum() / batch.completion_mask.sum()
    data = trainer._dataset_batch(inputs)
    d_side = trainer.algorithm.teacher_side(data, trainer.actor)
    d_logp = torch.log_softmax(d_side, -1).gather(-1, data.completion_ids.unsqueeze(-1)).squeeze(-1)
    assert sampled > (d_logp * data.completion_mask).sum() / data.completion_mask.sum()
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert all(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())


def test_peft_config_trains_the_students_adapters_only(tmp_path):
    from peft import LoraConfig

    tok = build_char_tokenizer()
    trainer = GKDTrainer(model=tiny_llama(tok), teacher_model=tiny_llama(tok, seed=1),
                         args=_config(tmp_path, max_steps=2, lmbda=0.5, learning_rate=1e-2), train_dataset=_rows(),
                         processing_class=tok, peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all("lora_" in n for n in changed)
    assert changed == {n for n, p in trainer.model.named_parameters() if p.requires_grad}


def test_a_served_teacher_of_another_tokenizer_is_aligned_like_the_local_one(tmp_path):
    from hf_verl.rollout.hf_engine import TransformersEngine
    from hf_verl.serve.server import RolloutServer

    student_tok, teacher_tok = build_char_tokenizer(), _permuted_char_tokenizer()
    local = _trainer(tmp_path, student_tok, teacher_tok, lmbda=1.0)
    server = RolloutServer(TransformersEngine(local.teacher_model.eval(), teacher_tok), teacher_tok, "teacher",
                           port=0).start()
    try:
        served = GKDTrainer(model=local.model, args=_config(tmp_path, lmbda=1.0, placement={"teacher": server.address}),
                            train_dataset=_rows(), processing_class=student_tok, teacher_processing_class=teacher_tok)
        assert served.algorithm.mode == "cross_tokenizer"
        batch, _ = served._rollout(served.data_collator([served.train_dataset[i] for i in range(4)]))
        got = served.algorithm.prepare(batch, served.actor, on_policy=True)
        want = local.algorithm.prepare(batch, local.actor, on_policy=True)
        assert torch.equal(got.batch.completion_mask, want.batch.completion_mask)
        torch.testing.assert_close(got.teacher, want.teacher, rtol=1e-4, atol=1e-4)
    finally:
        server.shutdown()
