"""`evaluate()` of the on-policy trainers: roll out the evaluation prompts with the training sampling settings and
report TRL's evaluation metrics (`eval_reward`, `eval_rewards/<source>/mean`, the completion length, the reward
functions' `log_metric` values and, where the algorithm defines one, `eval_loss`), prompts split over the
data-parallel ranks and sums reduced. Mixed into :class:`~hf_verl.trainers.on_policy.OnPolicyTrainer`."""

from __future__ import annotations

import itertools
from collections import defaultdict

import torch
from transformers import Trainer

from hf_verl.data.batch import RolloutBatch
from hf_verl.parallel import comm
from hf_verl.rewards.callables import combine_rewards
from hf_verl.trainers.round_data import is_iterable


class RolloutEvaluation:
    """The evaluation of an on-policy trainer (see the module docstring)."""

    def _eval_generations(self) -> int:
        """Completions per evaluation prompt (GRPO: `num_generations_eval`, else `num_generations`)."""
        return 1

    def _eval_loss(self, batch: RolloutBatch, rewards_per_func: torch.Tensor, group_size: int) -> float | None:
        """The training loss on one evaluation batch (whole groups of `group_size` rows), where the algorithm
        defines one (the critic-free family); None: not reported."""
        eval_loss = getattr(self.algorithm, "eval_loss", None)
        return None if eval_loss is None else eval_loss(batch, rewards_per_func, group_size, self.roles)

    def _eval_batches(self, dataset, prompts_per_batch: int):
        """This rank's evaluation prompts in batches: a map-style dataset split in contiguous shards, an iterable
        one (no length) read row by row, every data-parallel rank taking every `dp_size`-th row."""
        dims = self.dims
        if is_iterable(dataset):
            rows = itertools.islice(iter(dataset), dims.dp_rank, None, dims.dp_size)
        else:
            shard = dataset.shard(num_shards=dims.dp_size, index=dims.dp_rank, contiguous=True)
            rows = (shard[i] for i in range(len(shard)))
        while batch := list(itertools.islice(rows, prompts_per_batch)):
            yield batch

    @torch.no_grad()
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Roll out `_eval_generations()` completions per evaluation prompt with the training sampling settings
        and report the mean rewards (`<prefix>_reward`, `<prefix>_rewards/<func>/mean`), completion length, the
        reward functions' `log_metric` values and the training loss on those rollouts (`<prefix>_loss`, where the
        algorithm defines one); prompts are split across data-parallel ranks and the sums reduced. A dict of
        datasets is evaluated per entry (`<prefix>_<name>_...`); iterable (streaming) datasets are read once."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("evaluate() needs an eval_dataset (pass one here or to the trainer).")
        if isinstance(dataset, dict):
            metrics = {}
            for name, ds in dataset.items():
                metrics.update(self.evaluate(ds, ignore_keys, f"{metric_key_prefix}_{name}"))
            return metrics
        from tqdm.auto import tqdm

        self._sync_engine()
        for engine in self._trained_engines():
            engine.train(False)  # no dropout in the evaluation loss (training_step sets train mode back)
        dims = self.dims
        repeats = self._eval_generations()
        size = max(self.args.per_device_eval_batch_size // repeats, 1)  # prompts per batch
        n_funcs = len(self.reward_funcs)
        # sums: combined reward, completion tokens, rows, loss x rows, rows with a loss, then per function
        # (sum, count of non-None)
        totals = torch.zeros(5 + 2 * n_funcs, dtype=torch.float64)
        logged: dict[str, list[float]] = defaultdict(list)
        batches = self._eval_batches(dataset, size)
        # every rank runs as many batches as the busiest one (a forward may be a collective): a rank out of
        # prompts evaluates its first batch again and leaves it out of the sums
        first, done = None, False
        progress = tqdm(desc="Evaluating", disable=not self.is_local_process_zero())
        while True:
            prompts = None if done else next(batches, None)
            done = prompts is None
            if not bool(comm.reduce(dims, torch.tensor([0.0 if done else 1.0]), "max").item()):
                break
            counted = not done
            prompts = prompts if counted else first
            first = first or prompts
            if prompts is None:  # this rank had no prompt at all: nothing to run alongside the others
                continue
            rows = [row for row in prompts for _ in range(repeats)]
            collected = self._collect(rows, self.engine)  # the training rollout path (tools, rollout_func)
            batch, per_func = collected.batch, collected.rewards_per_func.double().cpu()
            loss = self._eval_loss(batch, collected.rewards_per_func, repeats)
            if not counted:
                continue
            combined = combine_rewards(per_func, self.args.reward_weights)
            totals[0] += combined.sum()
            totals[1] += batch.completion_mask.sum().item()
            totals[2] += len(rows)
            if loss is not None:
                totals[3] += loss * len(rows)
                totals[4] += len(rows)
            valid = ~per_func.isnan()
            totals[5::2] += torch.where(valid, per_func, 0.0).sum(0)
            totals[6::2] += valid.sum(0)
            for name, values in collected.reward_context.metrics.items():
                logged[name].extend(values)
            progress.update(1)
        progress.close()
        totals = comm.reduce(dims, totals, "sum")
        rows_seen = max(totals[2].item(), 1.0)
        metrics = {f"{metric_key_prefix}_reward": totals[0].item() / rows_seen,
                   f"{metric_key_prefix}_completions/mean_length": totals[1].item() / rows_seen}
        if totals[4].item() > 0:
            metrics[f"{metric_key_prefix}_loss"] = totals[3].item() / totals[4].item()
        for i, name in enumerate(self.reward_names):
            count = totals[6 + 2 * i].item()
            metrics[f"{metric_key_prefix}_rewards/{name}/mean"] = totals[5 + 2 * i].item() / count if count else float("nan")
        names = sorted({n for part in comm.gather_objects(dims, [sorted(logged)]) for n in part})
        if names:  # log_metric values: mean over every rank's values
            sums = torch.tensor([[sum(logged[n]), len(logged[n])] for n in names], dtype=torch.float64)
            sums = comm.reduce(dims, sums, "sum")
            for n, (total, count) in zip(names, sums.tolist()):
                if count:
                    metrics[f"{metric_key_prefix}_{n}"] = total / count
        Trainer.log(self, metrics)  # not self.log: the training metrics buffer stays for the next train log
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics
