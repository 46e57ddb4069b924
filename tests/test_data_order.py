"""The layout never changes the data order: for the same seed and global batch, one process, DDP / FSDP2 / ZeRO over
2 processes (half the per-device batch), TP=2, PP=2 and SP=2 (one data-parallel rank, the same per-device batch)
and PP=2 x DP=2 read the same global sequence of rows in the same order, with the default shuffled sampler.

The fast tests build, in this one process, the dataloader each rank of a layout builds: the trainer's own
`get_train_dataloader`, prepared by accelerate as for `num_processes` / `process_index` of that rank, with the
trainer's `dims` set to that rank's layout. Before each rank's dataloader the global RNG is reseeded with a
rank-dependent seed, as an engine may do (Megatron-Core seeds its model-parallel RNG on start, which on the CPU is
torch's default generator): the order must not follow it. The multi-process tests at the end run DPO for real at
TP=2 and SP=2 against one process.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from hf_verl.data.samplers import RepeatGroupSampler, ReplicaDeal, process_dp_ranks
from hf_verl.parallel.dims import ParallelDims
from tests.conftest import build_char_tokenizer

ROOT = Path(__file__).resolve().parents[1]

# name: (world size, ParallelDims.data_parallel keywords); the per-device batch is the global one over dp
LAYOUTS = {
    "one": (1, {}),
    "ddp": (2, {}),
    "fsdp2": (2, {"shard": True}),  # ZeRO's data-parallel group is the world, as FSDP2's
    "tp2": (2, {"tp": 2}),
    "pp2": (2, {"pp": 2}),
    "sp2": (2, {"sp": 2}),
    "pp2_dp2": (4, {"pp": 2}),  # pipeline stages are the outermost axis: one replica's ranks are 0 and 2
}


def _flat(batches) -> list[int]:
    return [i for batch in batches for i in batch]


def _dims(layout: str, rank: int) -> ParallelDims:
    world, kw = LAYOUTS[layout]
    kw = dict(kw)
    return ParallelDims.data_parallel(world, rank, shard=kw.pop("shard", False), **kw)


def _as_process(monkeypatch, trainer, dims: ParallelDims) -> None:
    """From now on `trainer` builds its dataloaders as process `dims.rank` of `dims.world_size` would: accelerate
    prepares them for that process (everything else as configured), and the trainer's layout is `dims`."""
    import accelerate.accelerator as accelerator_module
    from accelerate.data_loader import prepare_data_loader

    def prepare(dataloader, *args, **kwargs):
        kwargs.update(num_processes=dims.world_size, process_index=dims.rank)
        return prepare_data_loader(dataloader, *args, **kwargs)

    monkeypatch.setattr(accelerator_module, "prepare_data_loader", prepare)
    trainer.dims = dims


def _rank_batches(trainer, epochs: int) -> list[list[int]]:
    """The index batches the trainer's training dataloader gives this process over `epochs` epochs, as the
    Trainer's loop reads them (`set_epoch` before each epoch)."""
    loader = trainer.get_train_dataloader()
    out = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        out += [list(b) for b in loader.batch_sampler]
    return out


def _layout_steps(make_trainer, layout: str, monkeypatch, epochs: int = 2) -> list[list[int]]:
    """The global batch of each step of `layout`: per step, the data-parallel ranks' batches in dp order. Checks
    that the ranks of one replica (tp / pp / sp peers) read the same batches."""
    world, _ = LAYOUTS[layout]
    dp_size = _dims(layout, 0).dp_size
    trainer = make_trainer(dp_size)
    by_dp: dict[int, list] = {}
    for rank in range(world):
        dims = _dims(layout, rank)
        _as_process(monkeypatch, trainer, dims)
        torch.manual_seed(1000 + 17 * rank)  # an engine's reseed of the global RNG
        batches = _rank_batches(trainer, epochs)
        if dims.dp_rank in by_dp:
            assert batches == by_dp[dims.dp_rank], f"rank {rank} reads other batches than its replica's first rank"
        by_dp[dims.dp_rank] = batches
    steps = len(by_dp[0])
    assert all(len(b) == steps for b in by_dp.values())
    return [_flat(by_dp[d][s] for d in range(dp_size)) for s in range(steps)]


# ---------------------------------------------------------------------- DPO: transformers' sampler
def _dpo(tmp_path, **kw):
    from hf_verl import DPOTrainer
    from tests.test_dpo_trainer import _args, _data, _model

    tok = build_char_tokenizer()

    def make(dp_size: int):
        args = _args(tmp_path, per_device_train_batch_size=4 // dp_size, seed=5, **kw)
        return DPOTrainer(model=_model(tok), args=args, train_dataset=_data(8), processing_class=tok)

    return make


def test_dpo_order_is_the_seeds_not_the_global_rngs(tmp_path):
    """One process reads `randperm(n)` seeded with `seed` (TRL's order: transformers seeds the global RNG with
    `seed` in `Trainer.__init__` and accelerate's sampler takes that seed) and keeps it when something reseeds the
    global RNG before the dataloader is built, as Megatron-Core's engine does; `data_seed` replaces `seed`."""
    make = _dpo(tmp_path)
    trainer = make(1)
    n = len(trainer.train_dataset)
    want = torch.randperm(n, generator=torch.Generator().manual_seed(5)).tolist()
    assert _flat(_rank_batches(trainer, 1)) == want  # as built right after __init__ (no reseed)
    torch.manual_seed(42)  # Megatron-Core's default seed, as its engine sets it on the CPU
    assert _flat(_rank_batches(trainer, 1)) == want
    second = torch.randperm(n, generator=torch.Generator().manual_seed(6)).tolist()  # epoch 1: seed + 1
    assert _flat(_rank_batches(trainer, 2))[n:] == second

    seeded = _dpo(tmp_path, data_seed=9)(1)
    torch.manual_seed(42)
    assert _flat(_rank_batches(seeded, 1)) == torch.randperm(n, generator=torch.Generator().manual_seed(9)).tolist()


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "one"])
def test_dpo_every_layout_reads_one_process_global_batches(tmp_path, monkeypatch, layout):
    make = _dpo(tmp_path)
    want = _layout_steps(make, "one", monkeypatch)
    assert len(want) == 12 and all(len(b) == 4 for b in want)  # 24 rows, global batch 4, 2 epochs
    assert sorted(_flat(want[:6])) == list(range(24)) and want[:6] != want[6:]
    assert _layout_steps(make, layout, monkeypatch) == want


@pytest.mark.parametrize("layout", ["ddp", "tp2", "pp2_dp2"])
def test_dpo_with_drop_last_a_ragged_dataset_reads_the_same_rows(tmp_path, monkeypatch, layout):
    """26 rows in global batches of 4: the last 2 are dropped on every layout (`dataloader_drop_last=True`). Without
    it one process trains on a short last batch that DDP pads with the epoch's first rows (accelerate's
    `even_batches`)."""
    from hf_verl import DPOTrainer
    from tests.test_dpo_trainer import _args, _model

    tok = build_char_tokenizer()
    data = Dataset.from_dict({"prompt": [f"{chr(97 + i % 26)}=" for i in range(26)], "chosen": ["a"] * 26,
                              "rejected": ["b"] * 26})

    def make(dp_size):
        args = _args(tmp_path, per_device_train_batch_size=4 // dp_size, seed=5, dataloader_drop_last=True)
        return DPOTrainer(model=_model(tok), args=args, train_dataset=data, processing_class=tok)

    want = _layout_steps(make, "one", monkeypatch, epochs=1)
    assert len(want) == 6 and all(len(b) == 4 for b in want)
    assert _layout_steps(make, layout, monkeypatch, epochs=1) == want


# ---------------------------------------------------------------------- GRPO and PPO: RepeatGroupSampler
def _grpo(tmp_path):
    from hf_verl import GRPOTrainer
    from tests.test_grpo_trainer import _args, _model, count_a

    tok = build_char_tokenizer()
    prompts = [f"{chr(97 + i)}{chr(98 + i)}" for i in range(12)]

    def make(dp_size: int):
        args = _args(tmp_path, per_device_train_batch_size=8 // dp_size, steps_per_generation=2, seed=3)
        return GRPOTrainer(model=_model(tok), reward_funcs=count_a, processing_class=tok, args=args,
                           train_dataset=Dataset.from_dict({"prompt": prompts}))

    return make


def _ppo(tmp_path):
    from hf_verl import PPOTrainer
    from tests.test_ppo_trainer import _args, _critic, _policy, count_a

    tok = build_char_tokenizer()
    prompts = [f"{chr(97 + i)}{chr(98 + i)}" for i in range(24)]

    def make(dp_size: int):
        args = _args(tmp_path, per_device_train_batch_size=4 // dp_size, seed=3)
        return PPOTrainer(args=args, processing_class=tok, model=_policy(tok), reward_model=count_a,
                          value_model=_critic(tok), train_dataset=Dataset.from_dict({"prompt": prompts}))

    return make


def _rounds(steps: list[list[int]], repeat: int) -> list[list[int]]:
    """The rows of each round: a round's `repeat` micro-steps read the same rows."""
    rounds = [steps[i : i + repeat] for i in range(0, len(steps), repeat)]
    assert all(r == [r[0]] * repeat for r in rounds)
    return [r[0] for r in rounds]


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "one"])
@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_on_policy_every_layout_reads_one_process_rounds(tmp_path, monkeypatch, algo, layout):
    make = (_grpo if algo == "grpo" else _ppo)(tmp_path)
    repeat = make(1)._get_train_sampler().repeat  # steps_per_generation x num_iterations
    assert repeat > 1  # each round is read by several micro-steps
    want = _rounds(_layout_steps(make, "one", monkeypatch), repeat)
    assert len(want) >= 4 and len(set(map(tuple, want))) == len(want)
    assert _rounds(_layout_steps(make, layout, monkeypatch), repeat) == want


@pytest.mark.parametrize("layout", ["ddp", "tp2", "pp2", "pp2_dp2"])
def test_grpo_on_a_stream_every_layout_reads_one_process_rounds(tmp_path, monkeypatch, layout):
    """An iterable (streaming) train_dataset has no sampler: the stream is laid out in rounds and accelerate deals
    it to the processes. Before, at TP=2 / PP=2 the two ranks of the replica read alternate rounds (rank 0 rounds
    0, 2, 4, rank 1 rounds 1, 3, 5), and the replica trained on rank 0's: every other round was skipped."""
    from hf_verl import GRPOTrainer
    from tests.test_grpo_trainer import _args, _model, count_a

    tok = build_char_tokenizer()
    prompts = [f"{chr(97 + i)}{chr(98 + i)}" for i in range(12)]

    def steps(name):
        world, _ = LAYOUTS[name]
        dp_size = _dims(name, 0).dp_size
        by_dp = {}
        for rank in range(world):
            args = _args(tmp_path, per_device_train_batch_size=8 // dp_size, steps_per_generation=2, seed=3)
            trainer = GRPOTrainer(model=_model(tok), reward_funcs=count_a, processing_class=tok, args=args,
                                  train_dataset=Dataset.from_dict({"prompt": prompts}).to_iterable_dataset())
            dims = _dims(name, rank)
            _as_process(monkeypatch, trainer, dims)
            batches = [[row["prompt"] for row in batch] for batch in trainer.get_train_dataloader()]
            assert by_dp.setdefault(dims.dp_rank, batches) == batches, f"rank {rank} reads other rows than its replica"
        return [[p for d in range(dp_size) for p in by_dp[d][s]] for s in range(len(by_dp[0]))]

    want = _rounds(steps("one"), 2)
    assert len(want) == 3 and sorted(p for r in want for p in r) == sorted(p for p in prompts for _ in range(4))
    assert _rounds(steps(layout), 2) == want

@pytest.mark.parametrize("layout", ["one", "ddp", "tp2", "sp2", "pp2_dp2"])
def test_round_rows_are_the_rows_the_dataloader_gives_this_rank(tmp_path, monkeypatch, layout):
    """`_round_rows(g)` (asynchronous rollout reads round g + 1 ahead) is this rank's chunk of round g as its
    dataloader will give it, across the epoch boundary too, on every layout."""
    make = _grpo(tmp_path)
    world, _ = LAYOUTS[layout]
    trainer = make(_dims(layout, 0).dp_size)
    repeat = trainer._get_train_sampler().repeat
    for rank in range(world):
        _as_process(monkeypatch, trainer, _dims(layout, rank))
        chunks = _rounds(_rank_batches(trainer, 2), repeat)
        assert len(chunks) == 6  # 3 rounds an epoch
        for g, chunk in enumerate(chunks):
            assert [r["prompt"] for r in trainer._round_rows(g)] == [trainer.train_dataset[i]["prompt"] for i in chunk]


def test_sampler_deals_each_process_its_replicas_chunk():
    """PP=2 x DP=2: processes 0 and 2 are data-parallel rank 0, 1 and 3 rank 1; batch k goes to process k % 4."""
    dims = ParallelDims.data_parallel(4, 0, shard=False, pp=2)
    assert process_dp_ranks(dims) == [0, 1, 0, 1]
    assert process_dp_ranks(ParallelDims.data_parallel(4, 0, shard=False, tp=2)) == [0, 0, 1, 1]
    assert process_dp_ranks(ParallelDims.data_parallel(2, 1, shard=True)) == [0, 1]
    s = RepeatGroupSampler(num_prompts=4, num_generations=2, chunk_size=2, world_size=2, shuffle=False,
                           dp_ranks=[0, 1, 0, 1])
    idx = list(s)
    batches = [idx[i : i + 2] for i in range(0, len(idx), 2)]
    assert batches == [[0, 0], [1, 1], [0, 0], [1, 1], [2, 2], [3, 3], [2, 2], [3, 3]]
    assert len(s) == len(idx) and s.process_chunk(idx, 1, 2) == [2, 2] and s.process_chunk(idx, 1, 1) == [3, 3]
    # `copies` is the consecutive case
    assert RepeatGroupSampler(num_prompts=4, num_generations=2, chunk_size=2, world_size=2, copies=2).dp_ranks == [
        0, 0, 1, 1]
    with pytest.raises(ValueError, match="must name each of the 2 data-parallel ranks equally often"):
        RepeatGroupSampler(num_prompts=4, num_generations=2, chunk_size=2, world_size=2, dp_ranks=[0, 0, 1])


def test_replica_deal_gives_each_process_its_replicas_chunk():
    # blocks of dp_size=2 chunks of 2 (dp rank 0's, then 1's); PP=2 x DP=2 processes are dp ranks 0, 1, 0, 1
    stream = ReplicaDeal(range(9), chunk_size=2, dp_ranks=[0, 1, 0, 1])
    assert list(stream) == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7]  # the partial block (8) is dropped
    assert list(ReplicaDeal(range(4), chunk_size=2, dp_ranks=[0, 0])) == [0, 1, 0, 1, 2, 3, 2, 3]


def test_process_dp_ranks_agree_with_each_ranks_own_dims():
    for layout, (world, _) in LAYOUTS.items():
        want = [_dims(layout, r).dp_rank for r in range(world)]
        assert all(process_dp_ranks(_dims(layout, r)) == want for r in range(world))
    assert [_dims("pp2_dp2", r).dp_rank for r in range(4)] == [0, 1, 0, 1]


# ---------------------------------------------------------------------- real processes
def _env(**extra):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               ACCELERATE_USE_CPU="1", **extra)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def _run(out: Path, nproc: int, **env) -> list[dict]:
    from tests.test_megatron import _failure, _free_port

    out.mkdir()
    script = ["-m", "tests.distributed.data_order", str(out)]
    cmd = [sys.executable, *script] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
        str(_free_port()), *script]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(**env), capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, _failure(proc)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


@pytest.fixture(scope="module")
def dpo_one_process(tmp_path_factory):
    (one,) = _run(tmp_path_factory.mktemp("dpo-order") / "one", 1)
    return one


def _assert_same_run(want: dict, ranks: list[dict]) -> None:
    # the rows of each step, in order (a replica's ranks all read them), then what was trained on them
    assert len(want["steps"]) == 4 and len({tuple(s) for s in want["steps"]}) == 4
    for r in ranks:
        assert r["dp_size"] == 1
        assert r["steps"] == want["steps"]
    got = ranks[0]
    assert got["losses"] == pytest.approx(want["losses"], rel=1e-5, abs=1e-6)
    assert got["chosen_logps"] == pytest.approx(want["chosen_logps"], rel=1e-5, abs=1e-5)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.optional_backend
def test_dpo_at_tp2_trains_one_process_rows_in_order(dpo_one_process, tmp_path):
    """Megatron TP=2 (DP=1) with the default shuffled sampler: the reviewer's case (it read other rows from step 1,
    seeded by Megatron-Core's 42 instead of `seed`)."""
    pytest.importorskip("megatron.core")
    _assert_same_run(dpo_one_process, _run(tmp_path / "tp2", 2, ORDER_MEGATRON="2,1"))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_dpo_at_sp2_trains_one_process_rows_in_order(dpo_one_process, tmp_path):
    _assert_same_run(dpo_one_process, _run(tmp_path / "sp2", 2, ORDER_SP="2"))

