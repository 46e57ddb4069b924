"""What a run says about itself: one INFO line naming each role's layout, and third-party notices that ask
nothing of the user kept out (exact messages only; a user's own warnings and other messages pass)."""

import logging

import pytest

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


@pytest.mark.slow  # a fresh interpreter importing torch and transformers
def test_a_run_without_megatron_imports_nothing_of_megatron():
    """Importing megatron.core prints four "Transformer Engine and Apex are not installed" warnings per process: a
    facade that does not use Megatron (built, one rollout, the docs' `supported_parallelisms()`) imports nothing of
    it, in a fresh interpreter; megatron-core, where installed, is still listed (found on the path)."""
    import importlib.util
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys\n"
        "import hf_verl\n"
        "from tests.conftest import build_char_tokenizer\n"
        "from tests.test_facade import count_a, tiny_llama\n"
        "tok = build_char_tokenizer()\n"
        "trainer = hf_verl.Trainer(actor_model=tiny_llama(tok), tokenizer=tok, reward_model=count_a,\n"
        "                          config=dict(group_size=2, max_new_tokens=2, seed=0, use_async_rollout=False))\n"
        "rollout = trainer.rollout(['ab', 'cd'])\n"
        "print('ROWS', rollout.batch_size)\n"
        "print('PARALLELISMS', ','.join(trainer.supported_parallelisms()))\n"
        "print('MEGATRON', ','.join(sorted(m for m in sys.modules if m.startswith('megatron'))))\n")
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    env.update(PYTHONPATH=str(root), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) if " " in line else (line, "") for line in out.stdout.splitlines())
    assert lines["ROWS"] == "4"
    assert lines["MEGATRON"] == ""  # no module named megatron or megatron.*
    assert "Transformer Engine" not in out.stdout + out.stderr
    found = lines["PARALLELISMS"].split(",")
    if importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None:
        assert ("tensor" in found) == ("pipeline" in found) == ("data" in found)
    else:
        assert "tensor" not in found and "pipeline" not in found
