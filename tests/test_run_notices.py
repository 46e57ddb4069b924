"""What a run says about itself: one INFO line naming each role's layout, and third-party notices that ask
nothing of the user kept out (exact messages only; a user's own warnings and other messages pass)."""

import logging

from tests.conftest import build_char_tokenizer
from tests.test_grpo_trainer import _args, _model, count_a


def test_a_run_names_the_layout_of_each_role_once(tmp_path, caplog):
    from datasets import Dataset

    from hf_verl import GRPOTrainer

    tok = build_char_tokenizer()
    trainer = GRPOTrainer(model=_model(tok), reward_funcs=count_a, args=_args(tmp_path, max_steps=1, beta=0.1),
                          train_dataset=Dataset.from_dict({"prompt": ["abc", "xyz"] * 4}), processing_class=tok)
    with caplog.at_level(logging.INFO, logger="hf_verl"):
        trainer.train()
        trainer.train()  # a second train() of the same trainer says nothing new
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("hf_verl layout:")]
    assert lines == ["hf_verl layout: actor: plain one process (trained); reference: plain one process (frozen); "
                     "rollout: TransformersEngine (on the actor weights)"]


def test_deepspeeds_cpu_notice_is_dropped_and_nothing_else(caplog):
    import hf_verl  # noqa: F401  (installs the filters)

    deepspeed_logger = logging.getLogger("DeepSpeed")
    with caplog.at_level(logging.INFO):
        deepspeed_logger.warning("Setting accelerator to CPU. If you have GPU or other accelerator, we were unable "
                                 "to detect it.")
        deepspeed_logger.warning("ZeRO-3 partitioned 12 parameters")
        logging.getLogger("my_script").warning("Setting accelerator to CPU.")  # another logger: untouched
    assert [r.getMessage() for r in caplog.records] == ["ZeRO-3 partitioned 12 parameters",
                                                        "Setting accelerator to CPU."]
