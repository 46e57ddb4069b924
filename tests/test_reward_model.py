"""Hub reward models: real huggingface_hub resolution from an offline cache laid out by the test."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import build_bpe_tokenizer

REPO = "tiny-org/tiny-rm"
SNAPSHOT = "0123456789abcdef0123456789abcdef01234567"


def _tiny_rm(tokenizer):
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=len(tokenizer), num_labels=1,
                      pad_token_id=tokenizer.pad_token_id)
    return Qwen2ForSequenceClassification(cfg).eval()


@pytest.fixture
def offline_hub(tmp_path):
    tok = build_bpe_tokenizer()
    model = _tiny_rm(tok)
    snap = tmp_path / "hub" / f"models--{REPO.replace('/', '--')}" / "snapshots" / SNAPSHOT
    model.save_pretrained(snap)
    tok.save_pretrained(snap)
    refs = snap.parent.parent / "refs"
    refs.mkdir()
    (refs / "main").write_text(SNAPSHOT)
    return tmp_path, model, tok


def _run_offline(home: Path, code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          cwd=Path(__file__).parent.parent, timeout=120)


def test_reward_model_from_offline_hub_scores_with_its_own_tokenizer(offline_hub):
    home, model, tok = offline_hub
    code = (
        "import json\nfrom hf_verl.rewards.reward_model import RewardModelScorer\n"
        f"rm = RewardModelScorer({REPO!r})\n"
        "s = rm(prompts=['ab ', [{'role': 'user', 'content': 'hi'}]],"
        " completions=['cd', [{'role': 'assistant', 'content': 'yo'}]])\n"
        "print(json.dumps({'name': rm.__name__, 'scores': s, 'texts': rm.texts(['ab '], ['cd'])}))"
    )
    res = _run_offline(home, code)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["name"] == "tiny-rm" and out["texts"] == ["ab cd"]
    texts = ["ab cd", tok.apply_chat_template([{"role": "user", "content": "hi"},
                                               {"role": "assistant", "content": "yo"}], tokenize=False)]
    with torch.no_grad():
        expected = [model(**tok(t, return_tensors="pt", add_special_tokens=False)).logits[0, 0].item()
                    for t in texts]
    assert out["scores"] == pytest.approx(expected, abs=1e-5)
    assert out["scores"][0] != pytest.approx(out["scores"][1])


def test_unresolvable_reward_model_fails_fast_offline(tmp_path):
    start = time.monotonic()
    res = _run_offline(tmp_path, "from hf_verl.rewards.reward_model import RewardModelScorer\n"
                                 "RewardModelScorer('nobody/missing-rm')")
    assert time.monotonic() - start < 30
    assert res.returncode != 0
    assert "'nobody/missing-rm' is not a local folder and is not in the Hub cache" in res.stderr
