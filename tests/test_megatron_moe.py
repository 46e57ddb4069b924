"""Mixture of Experts on the Megatron engine (`backend="megatron"`), with expert parallelism.

Fast tests: the bridge's round trip for Qwen3-MoE, Qwen2-MoE (gated shared expert) and Mixtral, bit-exact at TP 1/2
x EP 1/2 (every rank's shards simulated); the routing each family gets in Megatron; the HF load-balancing loss the
engine computes against transformers' own; the refusals (DeepSeek-V3 and gpt-oss, a dense actor at EP > 1, layouts
that do not divide); the `expert_model_parallel_size` setting in the configs and an accelerate launch.
Multi-process tests (gloo, fp32, tiny models built in code): the engine against the HF model at EP=2 on 2
processes (log-probs, entropy, aux loss, export, one training step), at EP=2 x PP=2 and at EP=2 x TP=2 on 4 (the
latter with Megatron's sequence parallelism, which Megatron-Core needs to train an MoE under TP); GRPO, PPO, DPO
(aux loss on) and the facade at EP=2 against one process. Run them with `python -m pytest tests/test_megatron_moe.py -m multiprocess`.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("megatron.core")

from hf_verl.parallel.megatron.bridge import Bridge, ShardContext  # noqa: E402
from hf_verl.parallel.megatron.families import family_of, table_for  # noqa: E402
from hf_verl.parallel.megatron.model import architecture, check_layout  # noqa: E402
from tests.distributed.megatron_moe import FAMILIES, config, model  # noqa: E402
from tests.test_megatron import _env, _failure, _torchrun  # noqa: E402


# ---------------------------------------------------------------------- the bridge
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("ep", [1, 2])
def test_moe_bridge_round_trip_is_bit_exact(family, tp, ep):
    """HF -> every (TP, EP) rank's shards -> HF gives the same tensors bit for bit: each EP rank holds its half of
    the experts as Megatron's `local_experts.{j}`, each expert's gate/up and down split over the TP ranks."""
    hf = model(family)
    state = hf.state_dict()
    arch = architecture(hf.config)
    table = table_for(arch.family, "causal_lm", arch.tied)

    def ctx(t, e):
        return ShardContext(tp, t, arch.num_heads, arch.num_query_groups, arch.head_dim, arch.vocab_size,
                            arch.padded_vocab(tp), arch.num_experts, ep, e)

    def bridge(c):
        return Bridge(table, c, layer_offset=0, num_layers=arch.num_layers, first_stage=True, last_stage=True)

    shards = {(t, e): bridge(ctx(t, e)).load(lambda n: state[n]) for t in range(tp) for e in range(ep)}
    local = shards[(0, ep - 1)]
    fc1 = local["decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"]
    assert fc1.shape == (2 * arch.expert_size // tp, arch.hidden_size)
    assert sum(".local_experts." in k and k.endswith("fc1.weight") for k in local) == arch.num_layers * 4 // ep
    first = (ep - 1) * (4 // ep)  # the global index of the last EP rank's first expert
    gate_up = state["model.layers.1.mlp.experts.gate_up_proj"][first]
    assert torch.equal(fc1[: arch.expert_size // tp], gate_up[: arch.expert_size // tp])  # TP rank 0's gate rows

    def gather(name, t, m):
        return [shards[(r, 0)][name] for r in range(tp)] if m.tensor_parallel else [t]

    def gather_experts(name, mine, m):
        return [[shards[(r, e)][name.format(expert=j)] for r in (range(tp) if m.tensor_parallel else [0])]
                for e in range(ep) for j in range(len(mine))]

    back = dict(bridge(ctx(0, 0)).export(gather, shards[(0, 0)], gather_experts))
    assert set(back) == set(state)
    for name, tensor in back.items():
        assert torch.equal(tensor, state[name]), name


@pytest.mark.parametrize("family,pre_softmax,shared", [("qwen3_moe", False, None), ("qwen2_moe", True, 24),
                                                       ("mixtral", False, None)])
def test_each_family_routes_as_its_hf_model(family, pre_softmax, shared):
    """Renormalised top-k (Qwen3-MoE with norm_topk_prob, Mixtral) is Megatron's top-k over the logits then a softmax
    over the k; Qwen2-MoE here keeps the softmax over every expert (norm_topk_prob=False); Megatron's own aux loss
    is off."""
    from hf_verl.parallel.megatron.model import _moe_config

    arch = architecture(config(family))
    assert (arch.num_experts, arch.top_k, arch.expert_size) == (4, 2, 16)
    assert (arch.pre_softmax, arch.shared_expert_size) == (pre_softmax, shared)
    moe = _moe_config(arch, ep=2)
    assert moe["moe_router_pre_softmax"] is pre_softmax and moe["moe_router_load_balancing_type"] == "none"
    assert moe["expert_model_parallel_size"] == 2 and moe["moe_grouped_gemm"] is False
    assert moe.get("moe_shared_expert_gate", False) == (shared is not None)


def test_the_aux_loss_is_transformers_load_balancing_loss():
    """The engine's loss over Megatron's `[T, B, E]` router logits equals transformers' `load_balancing_loss_func`
    over HF's `[B x T, E]` ones, with padding excluded by the attention mask and without a mask."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from hf_verl.engine.megatron.scoring import load_balancing_loss

    torch.manual_seed(0)
    B, T, E = 3, 5, 6
    layers = [torch.randn(B, T, E) for _ in range(2)]
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, :2] = 0
    mask[2, 4:] = 0
    for m in (mask, None):
        want = load_balancing_loss_func(tuple(x.reshape(B * T, E) for x in layers), E, 2, m)
        got = load_balancing_loss([x.transpose(0, 1) for x in layers], 2, m)
        torch.testing.assert_close(got, want)


def test_what_the_bridge_cannot_express_is_refused_by_name():
    import transformers

    with pytest.raises(ValueError, match="cannot bridge model_type 'deepseek_v3'.*multi-head latent attention"):
        family_of(transformers.DeepseekV3Config())
    with pytest.raises(ValueError, match="cannot bridge model_type 'gpt_oss'.*attention sinks"):
        family_of(transformers.GptOssConfig())
    sparse_every_other = config("qwen3_moe")
    sparse_every_other.decoder_sparse_step = 2
    with pytest.raises(ValueError, match="every layer is sparse.*decoder_sparse_step=2"):
        architecture(sparse_every_other)
    arch = architecture(config("qwen3_moe"))
    with pytest.raises(ValueError, match="expert_model_parallel_size=3 must divide the model's 4 experts"):
        check_layout(arch, 1, 1, 3)
    from tests.distributed.megatron_logits import config as dense_config

    with pytest.raises(ValueError, match="expert_model_parallel_size=2 needs a Mixture-of-Experts model.*dense"):
        check_layout(architecture(dense_config("llama")), 1, 1, 2)


def test_expert_parallel_size_in_the_layout_and_the_configs(tmp_path, monkeypatch):
    from hf_verl import GRPOConfig
    from hf_verl.parallel.dims import ParallelDims
    from hf_verl.planner.capabilities import supported_parallelisms

    dims = ParallelDims.data_parallel(4, 3, shard=False, tp=2, ep=2)
    assert (dims.dp_size, dims.ep) == (2, 2)
    with pytest.raises(ValueError, match="expert_model_parallel_size=2 must divide the data-parallel size 1"):
        ParallelDims.data_parallel(2, 0, shard=False, tp=2, ep=2)
    common = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=8)
    monkeypatch.setenv("HF_VERL_MEGATRON_LAUNCH", "")
    with pytest.raises(ValueError, match="expert_model_parallel_size=2 needs backend='megatron'"):
        GRPOConfig(expert_model_parallel_size=2, **common)
    with pytest.raises(ValueError, match="expert_model_parallel_size must be an int >= 1"):
        GRPOConfig(backend="megatron", expert_model_parallel_size=0, **common)
    # an accelerate MEGATRON_LM launch (configs/accelerate/megatron_ep2_cpu.yaml exports these)
    monkeypatch.setenv("ACCELERATE_USE_MEGATRON_LM", "true")
    monkeypatch.setenv("MEGATRON_LM_TP_DEGREE", "1")
    monkeypatch.setenv("MEGATRON_LM_PP_DEGREE", "1")
    monkeypatch.setenv("MEGATRON_LM_EXPERT_MODEL_PARALLEL_SIZE", "2")
    args = GRPOConfig(**common)
    assert (args.backend, args.expert_model_parallel_size) == ("megatron", 2)
    with pytest.raises(ValueError, match="launch asks for expert_model_parallel_size=2 but GRPOConfig sets .*=4"):
        GRPOConfig(backend="megatron", expert_model_parallel_size=4, **common)
    assert "expert" in supported_parallelisms() or "tensor" not in supported_parallelisms()


# ---------------------------------------------------------------------- real processes
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.optional_backend
@pytest.mark.parametrize("tp,pp,ep,world", [(1, 1, 2, 2), (2, 1, 2, 4), (1, 2, 2, 4)],
                         ids=["ep2", "ep2xtp2", "ep2xpp2"])
def test_the_moe_engine_equals_the_hf_model(tmp_path, tp, pp, ep, world):
    """Every MoE family in one launch: log-probs / entropy / aux loss / a critic's values within 1e-5 of the HF model on each
    data-parallel rank's own rows, the export (experts gathered over EP and TP, stages in turn) bit-exact; one step
    of -log-prob + 0.1 x aux loss (no aux loss at PP=2) equals HF's (loss 1e-5, weights 5e-5)."""
    proc = _torchrun(world, "tests.distributed.megatron_moe", str(tmp_path), MEGATRON_TP=str(tp), MEGATRON_PP=str(pp),
                     MEGATRON_EP=str(ep))
    assert proc.returncode == 0, _failure(proc)
    for rank in range(world):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert (got["tp"], got["pp"], got["ep"], got["dp_size"]) == (tp, pp, ep, world // (tp * pp))
        assert set(got["families"]) == set(FAMILIES)
        for family, r in got["families"].items():
            assert r["export_names"] and r["export"] == 0.0, (rank, family)
            assert r["aux_value"] > 1.0, (rank, family)  # E x sum f_e p_e: 1 when balanced, here about 2 (top-2)
            for key in ("logprob", "entropy", "aux_loss", "loss", "values"):
                assert r[key] < 1e-5, (rank, family, key, r[key])
            assert r["weights"] < 5e-5, (rank, family, r["weights"], r["worst"])


@pytest.fixture(scope="module")
def moe_baseline(tmp_path_factory):
    """`baseline(algo)`: the run's output directory of one process on the default backend
    (tests/distributed/megatron_moe_parity.py), run once per algorithm when first asked."""
    out = {}

    def baseline(algo):
        if algo not in out:
            path = tmp_path_factory.mktemp(f"moe-{algo}-one-process")
            proc = subprocess.run([sys.executable, "-m", "tests.distributed.megatron_moe_parity", algo, str(path)],
                                  cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
            assert proc.returncode == 0, _failure(proc)
            out[algo] = path
        return out[algo]

    return baseline


def _accelerate_launch(config: str, algo: str, out: Path, **env) -> subprocess.CompletedProcess:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    environ = _env(**env)
    environ.pop("ACCELERATE_USE_CPU")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "configs" / "accelerate" / config), "--main_process_port", str(port),
           "-m", "tests.distributed.megatron_moe_parity", algo, str(out)]
    return subprocess.run(cmd, cwd=ROOT, env=environ, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.optional_backend
@pytest.mark.parametrize("algo", ["grpo", "ppo", "dpo", "facade"])
def test_trainers_on_megatron_ep2_equal_one_process(moe_baseline, tmp_path, algo):
    """EP=2 on 2 processes (two data-parallel ranks, two experts each) gives the one-process run's losses (1e-5
    relative) and final weights (5e-5); DPO with router_aux_loss_coef=0.05 (the global batch's aux loss, as one
    process has it). GRPO runs from the shipped accelerate
    config (configs/accelerate/megatron_ep2_cpu.yaml, nothing in the training config)."""
    from safetensors.torch import load_file

    if algo == "grpo":
        proc = _accelerate_launch("megatron_ep2_cpu.yaml", algo, tmp_path, MOE_EP="2", MOE_FROM_LAUNCH="1")
    else:
        proc = _torchrun(2, "tests.distributed.megatron_moe_parity", algo, str(tmp_path), MOE_EP="2")
    assert proc.returncode == 0, _failure(proc)
    want = json.loads((moe_baseline(algo) / "result.json").read_text())
    got = json.loads((tmp_path / "result.json").read_text())
    assert (got["backend"], got["world"], got["dp_size"], got["ep"]) == ("megatron", 2, 2, 2)
    assert got["export_names_match"] and got["export_max_error"] == 0.0
    assert got["losses"] == pytest.approx(want["losses"], rel=1e-5, abs=1e-6)
    a = load_file(str(moe_baseline(algo) / "final" / "model.safetensors"))
    b = load_file(str(tmp_path / "final" / "model.safetensors"))
    assert set(a) == set(b) and "model.layers.1.mlp.experts.3.down_proj.weight" in a  # transformers' saved layout
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 5e-5


@pytest.mark.slow
@pytest.mark.optional_backend
@pytest.mark.parametrize("pp", [1, 2], ids=["one-process", "pp2"])
def test_routing_replay_on_megatron_equals_the_accelerate_engines(tmp_path, pp):
    """`router_replay` on the Megatron engine (Megatron-Core's RouterReplay) against the accelerate engine (hf_verl's
    router tap), one process, every family: a record of other experts than the routers' own moves the log-probs by
    ~5e-3 on both, and the two engines' replayed log-probs agree within 1e-5
    (`tests/distributed/megatron_moe_replay.py`); at PP=2 on 2 processes each stage replays its layers (the metrics
    need one stage and are not compared there)."""
    if pp == 1:
        proc = subprocess.run([sys.executable, "-m", "tests.distributed.megatron_moe_replay", str(tmp_path)],
                              cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    else:
        proc = _torchrun(2, "tests.distributed.megatron_moe_replay", str(tmp_path), MEGATRON_PP="2")
    assert proc.returncode == 0, _failure(proc)
    result = json.loads((tmp_path / "result.json").read_text())
    assert set(result) == set(FAMILIES)
    for family, r in result.items():
        assert r["replayed"] < 1e-5 and r["own"] < 1e-5, (family, r)
        assert r["moved_megatron"] > 1e-3 and r["moved_accelerate"] > 1e-3, (family, r)
        if pp > 1:
            continue
        megatron, accelerate = r["metrics"]["megatron"], r["metrics"]["accelerate"]  # the routing metrics alike
        assert set(megatron) == set(accelerate) and "moe/expert_load_cv" in megatron, (family, r["metrics"])
        for name, value in accelerate.items():
            assert megatron[name] == pytest.approx(value, abs=1e-6), (family, name)
        assert 0 < megatron["moe/routing_agreement"] < 0.9
