"""The on-policy trainers' data in rounds: the collator (a batch is its rows), streaming (iterable) datasets laid out
in groups the way :class:`~hf_verl.data.samplers.RepeatGroupSampler` lays out a map-style one, and the checks TRL
makes on streaming datasets."""

from __future__ import annotations

import itertools
import logging

import torch

logger = logging.getLogger(__name__)


def rows_collator(rows: list[dict]) -> list[dict]:
    """The collator: a batch is the list of its rows (module level, so dataloader workers can pickle it)."""
    return rows


def is_iterable(dataset) -> bool:
    """A dataset read as a stream, without length or indexing (datasets' `IterableDataset`, a torch one)."""
    return isinstance(dataset, torch.utils.data.IterableDataset)


class GroupRounds(torch.utils.data.IterableDataset):
    """An iterable dataset laid out as :class:`~hf_verl.data.samplers.RepeatGroupSampler` lays out a map-style
    one: each round reads the next `prompts_per_round` rows of `source`, repeats each `num_generations` times,
    cuts the round into `world_size` chunks of `chunk_size` and yields the chunks `repeat` times (accelerate
    then hands batch `k` to process `k % world_size`). A trailing partial round is dropped."""

    def __init__(self, source, num_generations: int, chunk_size: int, world_size: int, repeat: int) -> None:
        self.source, self.num_generations = source, num_generations
        self.chunk_size, self.world_size, self.repeat = chunk_size, world_size, repeat

    def set_epoch(self, epoch: int) -> None:
        if callable(getattr(self.source, "set_epoch", None)):  # reshuffles a shuffled stream
            self.source.set_epoch(epoch)

    def __iter__(self):
        rows = iter(self.source)
        per_round = self.chunk_size * self.world_size // self.num_generations
        while len(prompts := list(itertools.islice(rows, per_round))) == per_round:
            completions = [row for row in prompts for _ in range(self.num_generations)]
            chunks = [completions[p * self.chunk_size:(p + 1) * self.chunk_size] for p in range(self.world_size)]
            for _ in range(self.repeat):
                for chunk in chunks:
                    yield from chunk


def check_iterable_datasets(args, train_dataset, eval_dataset) -> None:
    """Iterable (streaming) datasets, as TRL takes them: each process reads its own slice of the stream,
    so accelerate must not dispatch batches from the main process (`dispatch_batches=False`, set here);
    the training stream holds the groups in order, so it is read by one dataloader worker."""
    evals = eval_dataset.values() if isinstance(eval_dataset, dict) else [eval_dataset]
    if not any(is_iterable(ds) for ds in (train_dataset, *evals)):
        return
    if args.accelerator_config.dispatch_batches:
        raise ValueError("Iterable datasets require `dispatch_batches=False`, but it is set to `True` in "
                         "`accelerator_config`. Please set it to `False`.")
    args.accelerator_config.dispatch_batches = False
    if not is_iterable(train_dataset):
        return
    if args.dataloader_num_workers != 0:
        logger.warning("Iterable datasets require `dataloader_num_workers=0` to preserve prompt grouping; "
                       "overriding the provided value (%d).", args.dataloader_num_workers)
        args.dataloader_num_workers = 0
    if getattr(args, "use_async_rollout", False):
        raise ValueError("use_async_rollout=True needs a map-style train_dataset (the next round's prompts are "
                         "read ahead by index); load the dataset without streaming, or set use_async_rollout=False.")

