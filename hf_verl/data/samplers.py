"""Samplers that lay prompt groups out for on-policy RL across micro-steps and processes.

A *generation round* samples `num_generations` completions for each of `P` unique prompts: a
global batch of `P * num_generations` completions, cut into one contiguous chunk per process
(prompt-major, so a group may span two processes; the trainer gathers rewards before group
normalisation). Each chunk is yielded `repeat` times (`steps_per_generation * num_iterations`
micro-steps consume one round), once per micro-step, so that the `Trainer`'s step and epoch
bookkeeping stays that of an ordinary dataloader; the trainer rolls out on the first repeat and
serves the buffered round for the others.

Batches reach processes through accelerate's `BatchSamplerShard` (batch `k` goes to process
`k % num_processes`), so the order below is: for each repeat, the chunk of process 0, then 1, ... Under
sequence, tensor or pipeline parallelism several processes form one data-parallel replica and read the same
chunk; which chunk each process reads is its data-parallel rank (:func:`process_dp_ranks`), so the global
sequence of rounds is the same whatever the layout.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Sequence

import torch
from torch.utils.data import Sampler


class RepeatGroupSampler(Sampler[int]):
    """Index stream for generation rounds (see the module docstring).

    Args:
        num_prompts (`int`): dataset length.
        num_generations (`int`): completions per prompt.
        chunk_size (`int`): completions per process per round (the dataloader's batch size).
        world_size (`int`): number of processes.
        repeat (`int`): micro-steps that consume one round.
        shuffle (`bool`): shuffle prompts each epoch (with `seed + epoch`).
        seed (`int`): base seed.
        copies (`int`): consecutive processes that receive the same chunk (the ranks of one sequence-parallel
            group, which train on the same rows): `world_size` then counts data-parallel ranks.
        dp_ranks (`Sequence[int]`, *optional*): the data-parallel rank whose chunk each process reads, in process
            order (:func:`process_dp_ranks`); replaces `copies` where the ranks of one replica are not consecutive
            (pipeline stages are the outermost axis). Defaults to each of the `world_size` ranks `copies` times.
    """

    def __init__(self, num_prompts: int, num_generations: int, chunk_size: int, world_size: int = 1,
                 repeat: int = 1, shuffle: bool = True, seed: int = 0, copies: int = 1,
                 dp_ranks: Sequence[int] | None = None) -> None:
        round_size = chunk_size * world_size
        if round_size % num_generations:
            raise ValueError(
                f"a generation round of {round_size} completions ({chunk_size} per process x {world_size} "
                f"processes) does not hold whole groups of num_generations={num_generations}."
            )
        self.prompts_per_round = round_size // num_generations
        if num_prompts < self.prompts_per_round:
            raise ValueError(
                f"the dataset has {num_prompts} prompts but one generation round needs "
                f"{self.prompts_per_round}; add prompts or lower the generation batch size."
            )
        self.num_prompts, self.num_generations = num_prompts, num_generations
        self.chunk_size, self.world_size, self.repeat = chunk_size, world_size, repeat
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0
        self.copies = copies
        if dp_ranks is None:
            dp_ranks = [r for r in range(world_size) for _ in range(copies)]
        self.dp_ranks = list(dp_ranks)
        if sorted(self.dp_ranks) != sorted(list(range(world_size)) * (len(self.dp_ranks) // world_size)):
            raise ValueError(f"dp_ranks={self.dp_ranks} must name each of the {world_size} data-parallel ranks "
                             "equally often.")

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    @property
    def num_rounds(self) -> int:
        """Complete generation rounds per epoch (a trailing partial round is dropped)."""
        return self.num_prompts // self.prompts_per_round

    def __iter__(self):
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_prompts, generator=g).tolist()
        else:
            order = list(range(self.num_prompts))
        for r in range(self.num_rounds):
            prompts = order[r * self.prompts_per_round : (r + 1) * self.prompts_per_round]
            completions = [i for i in prompts for _ in range(self.num_generations)]
            chunks = [completions[p * self.chunk_size : (p + 1) * self.chunk_size] for p in range(self.world_size)]
            for _ in range(self.repeat):
                for dp_rank in self.dp_ranks:
                    yield from chunks[dp_rank]

    def __len__(self) -> int:
        return self.num_rounds * self.repeat * len(self.dp_ranks) * self.chunk_size

    def process_chunk(self, indices: list[int], local_round: int, process: int) -> list[int]:
        """The chunk `process` reads in round `local_round` of an epoch's index stream `indices` (`list(self)`)."""
        start = (local_round * self.repeat * len(self.dp_ranks) + process) * self.chunk_size
        return indices[start : start + self.chunk_size]


def process_dp_ranks(dims) -> list[int]:
    """The data-parallel rank of each process of `dims`' world (a
    :class:`~hf_verl.parallel.dims.ParallelDims`), in process order: the processes of one replica share it."""
    if dims.replica_size == 1:  # every process is a data-parallel rank of its own, in rank order
        return list(range(dims.dp_size))
    return [dataclasses.replace(dims, rank=p).dp_rank for p in range(dims.world_size)]


class ReplicaDeal(torch.utils.data.IterableDataset):
    """A stream laid out as :class:`RepeatGroupSampler` lays out indices for one process per data-parallel rank
    (blocks of `dp_size` chunks of `chunk_size` items, in data-parallel rank order), dealt to every process:
    accelerate's `IterableDatasetShard` hands process `p` the `p`-th `chunk_size` items of each `num_processes x
    chunk_size`, so each block becomes, for each process in order, the chunk of its data-parallel rank
    (`dp_ranks`, :func:`process_dp_ranks`). The ranks of one replica (sequence, tensor or pipeline peers) then read
    the same chunk, and no round is skipped. A trailing partial block is dropped."""

    def __init__(self, source: Iterable, chunk_size: int, dp_ranks: Sequence[int]) -> None:
        self.source, self.chunk_size, self.dp_ranks = source, chunk_size, list(dp_ranks)

    def set_epoch(self, epoch: int) -> None:
        if callable(getattr(self.source, "set_epoch", None)):
            self.source.set_epoch(epoch)

    def __iter__(self):
        rows, size, dp_size = iter(self.source), self.chunk_size, len(set(self.dp_ranks))
        while len(block := list(itertools.islice(rows, dp_size * size))) == dp_size * size:
            for dp_rank in self.dp_ranks:
                yield from block[dp_rank * size : (dp_rank + 1) * size]
