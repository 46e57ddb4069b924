"""Sharded loading (`hf_verl.parallel.sharded_load`): each rank reads only its own part of a safetensors checkpoint.

Fast: the byte-range reader against `safetensors.torch.load_file` over several dtypes, the shard / partition
arithmetic against `torch.chunk` and DeepSpeed's rule, the model built without weights, and the errors.
Multi-process: `tests/distributed/sharded_load.py` on 2 gloo processes, FSDP2 and ZeRO-3: the actor, a frozen
reference and a tied-embedding model, loaded sharded, equal `from_pretrained`'s whole load exactly (weights
gathered; the reference's logits too), and every parameter is really sharded (each rank holds about half).
The trainers' string path (`tests/distributed/sharded_load_trainers.py`, launched with the shipped FSDP2 / ZeRO-3
CPU configs): GRPO (2 steps) and DPO (1 step, actor and reference from the path) give the losses and final weights
of the same runs given the model loaded whole, and each rank read about half of every role's weights.
The facade's string roles (`tests/distributed/sharded_load_facade.py`, same configs): actor, KL reference and critic
given as paths train 2 steps exactly as the same run given the models loaded whole, each role read sharded.
"""

import json
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_verl.engine.registry import RoleLayout
from hf_verl.parallel.backend import BackendSpec
from hf_verl.parallel.dims import ParallelDims
from hf_verl.parallel.sharded_load import (
    CHECKPOINT_ATTR,
    SafetensorsCheckpoint,
    empty_model,
    load_sharded,
    loaded_sharded,
    partition_range,
    pending_checkpoint,
    shard_range,
    sharded_load_applies,
    state_sums,
    whole_copy,
)
from tests.distributed.sharded_load import save_tiny_llama

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tensors_file(tmp_path_factory):
    torch.manual_seed(0)
    tensors = {"f32": torch.randn(7, 5), "bf16": torch.randn(5, 3, 2).bfloat16(), "f16": torch.randn(9).half(),
               "i64": torch.arange(12).view(3, 4), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4)}
    path = tmp_path_factory.mktemp("st") / "model.safetensors"
    save_file(tensors, str(path))
    return path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    save_tiny_llama(str(path), tied=False, seed=3)
    return path


def test_reader_equals_safetensors(tensors_file):
    ckpt = SafetensorsCheckpoint(str(tensors_file.parent))
    whole = load_file(str(tensors_file))
    assert set(ckpt.entries) == set(whole)
    for name, tensor in whole.items():
        assert ckpt.entry(name).dtype == tensor.dtype and ckpt.entry(name).shape == tuple(tensor.shape)
        if tensor.dim() == 0:
            assert torch.equal(ckpt.read_rows(name, 0, 1), tensor)
            continue
        n = tensor.shape[0]
        for start, stop in [(0, n), (0, n // 2), (n // 2, n)] + ([(1, n - 1)] if n >= 2 else []):
            assert torch.equal(ckpt.read_rows(name, start, stop), tensor[start:stop]), (name, start, stop)
        flat = tensor.reshape(-1)
        if flat.numel():
            assert torch.equal(ckpt.read_flat(name, 1, flat.numel()), flat[1:]), name
    out = torch.empty(2, 5)
    assert ckpt.read_rows("f32", 3, 5, out=out) is not None and torch.equal(out, whole["f32"][3:5])


def test_reader_errors(tensors_file, tmp_path):
    ckpt = SafetensorsCheckpoint(str(tensors_file.parent))
    with pytest.raises(ValueError, match=r"elements \[0, 99\) are outside 'f16'"):
        ckpt.read_flat("f16", 0, 99)
    with pytest.raises(ValueError, match="needs a contiguous CPU torch.float32 tensor of 5 elements"):
        ckpt.read_rows("f32", 0, 1, out=torch.empty(5, dtype=torch.float64))
    with pytest.raises(KeyError, match="'nope' is not in the checkpoint"):
        ckpt.read_flat("nope", 0, 0)
    with pytest.raises(FileNotFoundError, match="no .safetensors file in .*save_pretrained\\(safe_serialization=True\\)"):
        SafetensorsCheckpoint(str(tmp_path))
    truncated = tmp_path / "model.safetensors"
    truncated.write_bytes(tensors_file.read_bytes()[:-40])
    with pytest.raises(ValueError, match="truncated"):
        ckpt2 = SafetensorsCheckpoint(str(tmp_path))
        for name, entry in ckpt2.entries.items():
            ckpt2.read_flat(name, 0, entry.numel)
    (tmp_path / "model.safetensors").write_bytes(b"\x04\x00\x00\x00\x00\x00\x00\x00{{{{")
    with pytest.raises(ValueError, match="not a safetensors file"):
        SafetensorsCheckpoint(str(tmp_path))


@pytest.mark.parametrize("length", [0, 1, 5, 8, 97])
@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_shard_range_is_torch_chunk(length, parts):
    chunks = list(torch.arange(length).chunk(parts)) if length else []
    for index in range(parts):
        start, stop = shard_range(length, parts, index)
        expected = chunks[index].tolist() if index < len(chunks) else []
        assert list(range(start, stop)) == expected


def test_partition_range_is_deepspeeds():
    # DeepSpeed pads numel up to a multiple of the partitions and cuts it evenly
    assert [partition_range(10, 4, i) for i in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert [partition_range(8, 2, i) for i in range(2)] == [(0, 4), (4, 8)]
    assert [partition_range(1, 2, i) for i in range(2)] == [(0, 1), (1, 1)]
    with pytest.raises(ValueError, match="partition 2 of 2 does not exist"):
        partition_range(4, 2, 2)


def _layout(kind, world=2, stage=0, engine="accelerate"):
    backend = BackendSpec(kind=kind, zero_stage=stage)
    dims = ParallelDims.data_parallel(world, 0, shard=backend.shards)
    return RoleLayout(backend=backend, dims=dims, engine=engine)


def test_when_loading_is_sharded():
    assert sharded_load_applies(_layout("fsdp2"))
    assert sharded_load_applies(_layout("deepspeed", stage=3))
    assert not sharded_load_applies(_layout("deepspeed", stage=2))
    assert not sharded_load_applies(_layout("ddp"))
    assert not sharded_load_applies(_layout("fsdp2", world=1))
    assert not sharded_load_applies(_layout("plain", world=1))


def test_empty_model_builds_without_weights(llama_dir):
    from transformers import AutoModelForCausalLM

    model = empty_model(str(llama_dir))
    whole = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32)
    assert all(p.is_meta for p in model.parameters())
    assert pending_checkpoint(model) == str(llama_dir)
    assert not model.training
    names = dict(model.named_parameters())
    assert {k: tuple(v.shape) for k, v in names.items()} == {k: tuple(v.shape) for k, v in whole.named_parameters()}
    buffers = dict(model.named_buffers())
    for name, buf in whole.named_buffers():  # rotary inv_freq: built for real, as from_pretrained builds it
        assert not buffers[name].is_meta and torch.equal(buffers[name], buf)
    assert model.config._attn_implementation == whole.config._attn_implementation


def test_load_sharded_refuses_unsharded_layouts(llama_dir):
    with pytest.raises(ValueError, match="needs FSDP2 or DeepSpeed ZeRO-3 over 2 or more .* ddp"):
        load_sharded(str(llama_dir), _layout("ddp"))


def test_engine_refuses_a_pending_model_off_fsdp2(llama_dir):
    from hf_verl.engine.registry import make_engine

    model = empty_model(str(llama_dir))
    with pytest.raises(ValueError, match="built without its weights for FSDP2 .* runs on plain: load it with"):
        make_engine(model, "reference", _layout("plain", world=1), trainable=False)
    setattr(model, CHECKPOINT_ATTR, None)
    assert pending_checkpoint(model) is None


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               DS_ACCELERATOR="cpu")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("backend", ["fsdp2", pytest.param("zero3", marks=pytest.mark.optional_backend)])
def test_sharded_load_equals_whole_load(backend, tmp_path):
    if backend == "zero3":
        pytest.importorskip("deepspeed")
    untied, tied, out = tmp_path / "untied", tmp_path / "tied", tmp_path / "result.json"
    save_tiny_llama(str(untied), tied=False, seed=1)
    save_tiny_llama(str(tied), tied=True, seed=2)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
           "-m", "tests.distributed.sharded_load", backend, str(untied), str(tied), str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    result = json.loads(out.read_text())
    assert set(result) == {"actor", "reference", "tied"}
    for case, r in result.items():
        assert r["sharded"], case
        assert 0.45 < r["share"] < 0.55, (case, r["share"])  # each of the 2 ranks holds about half
        assert r["same_names"] and r["attn"], case
        assert r["weight_diff"] == 0.0, (case, r["weight_diff"])  # exactly the checkpoint's bytes
    assert result["reference"]["logit_diff"] <= 1e-6
    assert result["tied"]["still_tied"]
    if backend == "fsdp2":
        assert result["actor"]["grad_diff"] == 0.0


def test_whole_copy_reads_the_generation_replica_whole(tmp_path):
    from transformers import AutoModelForCausalLM

    save_tiny_llama(str(tmp_path), tied=False, seed=3)
    pending = empty_model(str(tmp_path))
    assert loaded_sharded(pending)
    replica = whole_copy(pending)
    whole = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    assert not loaded_sharded(replica) and not loaded_sharded(whole)
    assert replica is not pending and pending_checkpoint(pending) == str(tmp_path)  # the original stays pending
    expected = whole.state_dict()
    got = replica.state_dict()
    assert set(got) == set(expected)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert not any(p.requires_grad for p in replica.parameters())
    with pytest.raises(ValueError, match="not built by load_sharded"):
        whole_copy(whole)


@pytest.mark.parametrize("tied", [False, True])
def test_state_sums_from_the_checkpoint_equal_the_whole_models(tmp_path, tied):
    from transformers import AutoModelForCausalLM

    save_tiny_llama(str(tmp_path), tied=tied, seed=4)
    whole = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    expected = [(k, tuple(v.shape), v.double().sum().item()) for k, v in whole.state_dict().items()]
    assert sorted(state_sums(empty_model(str(tmp_path)))) == sorted(expected)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("backend", ["fsdp2", pytest.param("zero3", marks=pytest.mark.optional_backend)])
def test_trainers_given_a_path_load_sharded_and_train_as_a_whole_load(backend, tmp_path):
    if backend == "zero3":
        pytest.importorskip("deepspeed")
    from tests.conftest import build_char_tokenizer
    from tests.distributed.sharded_load_trainers import save_tiny_llama as save_for_trainers

    save_for_trainers(str(tmp_path / "model"), build_char_tokenizer())
    env = {k: v for k, v in _env().items() if k not in ("ACCELERATE_USE_CPU", "DS_ACCELERATOR")}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"configs/accelerate/{backend}_cpu.yaml",
           "--main_process_port", str(_free_port()), "-m", "tests.distributed.sharded_load_trainers",
           str(tmp_path / "model"), str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    label = "fsdp2" if backend == "fsdp2" else "deepspeed ZeRO-3"
    marker = "FSDP2" if backend == "fsdp2" else "ZeRO-3"
    for algo, roles in (("grpo", 2), ("dpo", 2)):  # GRPO: actor + its reference copy; DPO: actor + reference path
        r = result[algo]
        assert r["sharded"]["backend"] == r["whole"]["backend"] == label
        assert r["sharded"]["losses"] == r["whole"]["losses"] and len(r["whole"]["losses"]) == (2 if algo == "grpo" else 1)
        assert r["same_names"] and r["weight_diff"] == 0.0, r["weight_diff"]
        assert r["trained"] > 1e-3  # the runs did move the weights
        assert r["whole"]["lines"] == [[], []]  # a model object is used as given: nothing read from files
        for lines in r["sharded"]["lines"]:  # per rank: every role read sharded, about half of the elements
            loads = [line for line in lines if line.startswith(f"sharded load ({marker})")]
            assert len(loads) == roles, lines
            for line in loads:
                read, total = (int(x) for x in line.split("(")[-1].split(" parameter")[0].split(" of "))
                assert 0.45 < read / total < 0.55, line
            assert any(line.startswith("generation replica") for line in lines) == (algo == "grpo")
    assert result["dpo"]["sharded"]["digest"] == result["dpo"]["whole"]["digest"]


def test_facade_role_loads_for_its_layout(llama_dir, caplog):
    """LazyModel.get(layout=...): sharded (pending, not moved) where sharded loading applies, from_pretrained
    otherwise; a value head the causal-LM checkpoint lacks loads whole (from_pretrained initialises it)."""
    import logging

    from transformers import AutoModelForCausalLM

    from hf_verl.facade.roles import LazyModel, vocab_size

    sharded = LazyModel("actor", str(llama_dir), "causal_lm").get(layout=_layout("fsdp2"))
    assert loaded_sharded(sharded) and pending_checkpoint(sharded) == str(llama_dir)
    assert all(p.dtype == torch.float32 for p in sharded.parameters())  # dtype "auto": the config's
    whole = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32)
    assert vocab_size(sharded) == vocab_size(whole)
    for layout in (None, _layout("ddp"), _layout("fsdp2", world=1)):
        model = LazyModel("reference", str(llama_dir), "causal_lm").get(layout=layout)
        assert not loaded_sharded(model)
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), whole.state_dict().values()))
    explicit = LazyModel("actor", whole, "causal_lm")
    assert explicit.get(layout=_layout("fsdp2")) is whole  # an object is used as given
    with caplog.at_level(logging.INFO, logger="hf_verl.facade.roles"):
        critic = LazyModel("critic", str(llama_dir), "value").get(layout=_layout("fsdp2"))
    assert not loaded_sharded(critic) and critic.score.weight.shape[0] == 1
    assert "whole on every rank: its checkpoint has no weights for ['score.weight']" in caplog.text


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("backend", ["fsdp2", pytest.param("zero3", marks=pytest.mark.optional_backend)])
def test_facade_given_paths_loads_sharded_and_trains_as_a_whole_load(backend, tmp_path):
    if backend == "zero3":
        pytest.importorskip("deepspeed")
    from tests.conftest import build_char_tokenizer
    from tests.distributed.sharded_load_facade import save_models

    save_models(str(tmp_path / "models"), build_char_tokenizer())
    env = {k: v for k, v in _env().items() if k not in ("ACCELERATE_USE_CPU", "DS_ACCELERATOR")}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"configs/accelerate/{backend}_cpu.yaml",
           "--main_process_port", str(_free_port()), "-m", "tests.distributed.sharded_load_facade",
           str(tmp_path / "models"), str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    label = "fsdp2" if backend == "fsdp2" else "deepspeed ZeRO-3"
    marker = "FSDP2" if backend == "fsdp2" else "ZeRO-3"
    assert result["sharded"]["backends"] == result["whole"]["backends"] == dict.fromkeys(
        ("actor", "reference", "critic"), label)
    assert result["sharded"]["losses"] == result["whole"]["losses"] and len(result["whole"]["losses"]) == 2
    for role in ("actor", "critic"):
        assert result[f"{role}_same_names"] and result[f"{role}_weight_diff"] == 0.0, result[f"{role}_weight_diff"]
        assert result[f"{role}_trained"] > 1e-3  # the runs did move the weights
    assert result["whole"]["lines"] == [[], []]  # model objects are used as given: nothing read from files
    for lines in result["sharded"]["lines"]:  # per rank: actor, reference and critic read sharded, about half each
        loads = [line for line in lines if line.startswith(f"sharded load ({marker})")]
        assert len(loads) == 3, lines
        for line in loads:
            read, total = (int(x) for x in line.split("(")[-1].split(" parameter")[0].split(" of "))
            assert 0.45 < read / total < 0.55, line
        assert sum(line.startswith("generation replica") for line in lines) == 1, lines


def _by_hand_snippet() -> str:
    """docs/loading.md's "By hand" code block, as the page has it."""
    text = (ROOT / "docs" / "loading.md").read_text()
    start = text.index("By hand, for a role of your own")
    block = text[text.index("```python\n", start) + len("```python\n"):]
    return block[:block.index("```")]


# what each process reports after the snippet: its layout and how its actor's parameters are held
_REPORT = """
import json as _json
import torch as _torch
import torch.distributed as _dist

_rank, _world = (_dist.get_rank(), _dist.get_world_size()) if _dist.is_initialized() else (0, 1)
_params = list(actor.model.parameters())
_held = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else
            (p.to_local().numel() if hasattr(p, "to_local") else p.numel()) for p in _params)
_whole = sum(getattr(p, "ds_numel", None) or p.numel() for p in _params)
print("SNIPPET " + _json.dumps({"rank": _rank, "world": _world, "backend": layout.backend.label,
                               "sharded": sharded_load_applies(layout), "share": _held / _whole}), flush=True)
"""


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("launch", ["one process", "fsdp2",
                                    pytest.param("zero3", marks=pytest.mark.optional_backend)])
def test_the_by_hand_snippet_runs_as_written(launch, tmp_path):
    """docs/loading.md's "By hand" snippet, read from the page, run as a script: under `accelerate launch` with the
    shipped CPU configs over 2 processes (nothing formed a process group: launch_role_layout joins it) each rank
    holds about half of the actor; in one process it loads whole (its `else` branch)."""
    if launch == "zero3":
        pytest.importorskip("deepspeed")
    save_tiny_llama(str(tmp_path / "model"), tied=False, seed=5)
    snippet = _by_hand_snippet()
    assert snippet.count('"org/model-or-dir"') == 2  # the page's placeholders, replaced by the tiny model
    script = tmp_path / "by_hand.py"
    script.write_text(snippet.replace('"org/model-or-dir"', repr(str(tmp_path / "model"))) + _REPORT)
    env = {k: v for k, v in _env().items() if k not in ("ACCELERATE_USE_CPU", "DS_ACCELERATOR")}
    if launch == "one process":
        cmd = [sys.executable, str(script)]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               f"configs/accelerate/{launch}_cpu.yaml", "--main_process_port", str(_free_port()), str(script)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    # the ranks print to one pipe at once: a report may follow another on its line, so each is found on its own
    reports = sorted((json.loads(m) for m in re.findall(r"SNIPPET (\{[^{}]*\})", proc.stdout)),
                     key=lambda r: r["rank"])
    if launch == "one process":
        assert reports == [{"rank": 0, "world": 1, "backend": "plain", "sharded": False, "share": 1.0}]
        return
    label = "fsdp2" if launch == "fsdp2" else "deepspeed ZeRO-3"
    assert [(r["rank"], r["world"], r["backend"], r["sharded"]) for r in reports] == [
        (0, 2, label, True), (1, 2, label, True)]
    for r in reports:
        assert 0.45 < r["share"] < 0.55, r  # the 97-row vocabulary splits unevenly: about half each
