"""The datasets of the preference trainers (DPO, reward modelling), prepared one way: what both share.

:class:`PreferenceData` is mixed into :class:`~hf_verl.trainers.dpo_trainer.DPOTrainer` and
:class:`~hf_verl.trainers.reward_trainer.RewardTrainer`. It refuses vision datasets, takes an evaluation dataset
alone or as a dict / `DatasetDict` / `IterableDatasetDict` of them (each prepared as its own split), reads the
columns of map-style and streaming datasets alike, passes a dataset that already holds the trainer's token columns
through, checks the `chosen` / `rejected` columns of the others, and tokenises them row by row with the trainer's
own function. What each trainer tokenises, and what it does with the result (DPO's truncation counts, the reward
model's length filter), are its hooks. Also here: `preference_accuracy`, the `compute_metrics` of both.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from hf_verl.data.preference import check_preference_columns

logger = logging.getLogger(__name__)

_PREFERENCE_METRIC = None


def preference_accuracy(eval_pred) -> dict[str, float]:
    """`compute_metrics` for DPO and reward-model evaluation, through `evaluate` (the metric ships with hf_verl, so
    it loads offline): share of pairs whose score (DPO's implicit reward, a reward model's output) ranks chosen
    first.

    `eval_pred.predictions` holds `(chosen_score, rejected_score)` per pair.
    """
    global _PREFERENCE_METRIC
    import evaluate
    import numpy as np

    from hf_verl.metrics import metric_path

    if _PREFERENCE_METRIC is None:
        _PREFERENCE_METRIC = evaluate.load(metric_path("preference_accuracy"))
    preds = np.asarray(eval_pred.predictions, dtype=np.float64)
    return _PREFERENCE_METRIC.compute(chosen_scores=preds[:, 0], rejected_scores=preds[:, 1])


def dataset_columns(dataset) -> list[str]:
    """The column names of a map-style or streaming dataset (a stream that does not declare them: its first row's)."""
    return list(getattr(dataset, "column_names", None) or next(iter(dataset)).keys())


def is_streaming(dataset) -> bool:
    from datasets import IterableDataset

    return isinstance(dataset, IterableDataset)


class PreferenceData:
    """Preparing a preference trainer's datasets (see the module docstring).

    A trainer sets `_token_columns` (the columns of a dataset it need not tokenise) and `_needs` (the end of the
    missing-column message), and implements :meth:`_row_tokenizer`; it may override :meth:`_check_dataset` (refuse
    a dataset before anything is done to it) and :meth:`_after_tokenizing`.
    """

    _token_columns: tuple[str, ...] = ()
    _needs: str = "'chosen' and 'rejected' (and optionally 'prompt')"

    @classmethod
    def _check_vision(cls, train_dataset, eval_dataset) -> None:
        """hf_verl's preference trainers train text-only models: refuse image columns up front (TRL's message, with
        the reason)."""
        datasets = [train_dataset] + (list(eval_dataset.values()) if isinstance(eval_dataset, dict) else
                                      [eval_dataset] if eval_dataset is not None else [])
        for dataset in datasets:
            columns = dataset_columns(dataset)
            if "image" in columns or "images" in columns:
                raise ValueError("The dataset appears to be vision-related (it has an 'image' or 'images' column), "
                                 f"but hf_verl's {cls.__name__} trains text-only models: a vision-language model "
                                 f"is not supported. Drop the image columns or use TRL's {cls.__name__}.")

    def _prepare_eval_dataset(self, eval_dataset, tokenizer, args):
        """A dataset, or a dict / `DatasetDict` / `IterableDatasetDict` of them (each prepared as its own split)."""
        if eval_dataset is None:
            return None
        if isinstance(eval_dataset, dict):
            return {name: self._prepare_dataset(ds, tokenizer, args, name) for name, ds in eval_dataset.items()}
        return self._prepare_dataset(eval_dataset, tokenizer, args, "eval")

    def _prepare_dataset(self, dataset, tokenizer, args, name: str):
        """`dataset` tokenised for this trainer (or passed through when it holds the token columns already), then
        handed to :meth:`_after_tokenizing`."""
        if dataset is None:
            return None
        self._check_dataset(dataset, args, name)
        columns = dataset_columns(dataset)
        tokenized = bool(self._token_columns) and all(c in columns for c in self._token_columns)
        if not tokenized:
            check_preference_columns(columns, f"{type(self).__name__} needs {self._needs}.")

            dataset = dataset.map(self._row_tokenizer(tokenizer, args), with_indices=True,
                                  **self._map_kwargs(dataset, args, f"Tokenizing the {name} preference dataset"))
        return self._after_tokenizing(dataset, args, name, tokenized_here=not tokenized)

    @staticmethod
    def _map_kwargs(dataset, args, desc: str) -> dict[str, Any]:
        """`Dataset.map` / `filter` options: processes and a progress label (a stream takes neither)."""
        return {} if is_streaming(dataset) else {"num_proc": args.dataset_num_proc, "desc": desc}

    def _check_dataset(self, dataset, args, name: str) -> None:
        """Refuse `dataset` before it is prepared (nothing by default)."""

    def _row_tokenizer(self, tokenizer, args) -> Callable[[dict, int], dict]:
        """`f(row, index)` -> the row's token columns: a module-level function with its arguments bound
        (`functools.partial`), so that `datasets` can hash it for its cache and send it to worker processes."""
        raise NotImplementedError

    def _after_tokenizing(self, dataset, args, name: str, *, tokenized_here: bool):
        """The prepared dataset (filtered, counted); `tokenized_here`: False when it came tokenised."""
        return dataset
