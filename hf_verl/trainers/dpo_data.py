"""DPO's preference data: the datasets tokenised into pairs (prompt, chosen, rejected; truncation, identical and
dropped pairs counted), the refusal of vision datasets, and the `compute_metrics` of preference accuracy through
`evaluate`. Mixed into :class:`~hf_verl.trainers.dpo_trainer.DPOTrainer`."""

from __future__ import annotations

import logging

from hf_verl.data.preference import check_preference_columns, tokenize_pair
from hf_verl.trainers.dpo_config import DPOConfig

logger = logging.getLogger(__name__)

TOKEN_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")

_PREFERENCE_METRIC = None


def preference_accuracy(eval_pred) -> dict[str, float]:
    """`compute_metrics` for DPO evaluation, through `evaluate` (the metric ships with hf_verl, so
    it loads offline): share of pairs whose implicit reward ranks chosen first.

    `eval_pred.predictions` holds `(chosen_reward, rejected_reward)` per pair.
    """
    global _PREFERENCE_METRIC
    import evaluate
    import numpy as np

    from hf_verl.metrics import metric_path

    if _PREFERENCE_METRIC is None:
        _PREFERENCE_METRIC = evaluate.load(metric_path("preference_accuracy"))
    preds = np.asarray(eval_pred.predictions, dtype=np.float64)
    return _PREFERENCE_METRIC.compute(chosen_scores=preds[:, 0], rejected_scores=preds[:, 1])


def _is_vision_row(row: dict) -> bool:
    return "image" in row or "images" in row


class PreferenceData:
    """Tokenising and checking DPO's datasets (see the module docstring)."""

    @staticmethod
    def _check_vision(train_dataset, eval_dataset) -> None:
        """hf_verl's DPO trains text-only causal LMs: refuse image columns up front (TRL's message, with the reason)."""
        datasets = [train_dataset] + (list(eval_dataset.values()) if isinstance(eval_dataset, dict) else
                                      [eval_dataset] if eval_dataset is not None else [])
        for dataset in datasets:
            columns = getattr(dataset, "column_names", None) or list(next(iter(dataset)).keys())
            if _is_vision_row(dict.fromkeys(columns)):
                raise ValueError("The dataset appears to be vision-related (it has an 'image' or 'images' column), "
                                 "but hf_verl's DPOTrainer trains text-only causal LMs: a vision-language model "
                                 "is not supported. Drop the image columns or use TRL's DPOTrainer.")

    def _prepare_eval_dataset(self, eval_dataset, tokenizer, args: DPOConfig):
        """A dataset, or a dict / `DatasetDict` / `IterableDatasetDict` of them (each tokenised as its own split)."""
        if eval_dataset is None:
            return None
        if isinstance(eval_dataset, dict):
            return {name: self._prepare_dataset(ds, tokenizer, args, name) for name, ds in eval_dataset.items()}
        return self._prepare_dataset(eval_dataset, tokenizer, args, "eval")

    def _prepare_dataset(self, dataset, tokenizer, args: DPOConfig, name: str):
        if dataset is None:
            return None
        from datasets import IterableDataset

        if isinstance(dataset, IterableDataset):
            if args.precompute_ref_log_probs:
                raise ValueError(
                    f"precompute_ref_log_probs=True is not supported with IterableDataset (the {name} dataset): the "
                    "log-probs are stored as columns of a map-style dataset. Load it without streaming, or set "
                    "precompute_ref_log_probs=False."
                )
            columns = dataset.column_names or list(next(iter(dataset)).keys())
        else:
            columns = dataset.column_names
        if all(c in columns for c in TOKEN_COLUMNS):
            return dataset  # already tokenised
        check_preference_columns(columns)

        def tokenize(row, idx):
            pair = tokenize_pair(row, tokenizer, args.max_length, args.truncation_mode, index=idx)
            return {"prompt_ids": pair.prompt_ids, "chosen_ids": pair.chosen_ids, "rejected_ids": pair.rejected_ids,
                    "truncated": pair.truncated, "identical": pair.identical}

        map_kwargs = {} if isinstance(dataset, IterableDataset) else {
            "num_proc": args.dataset_num_proc, "desc": f"Tokenizing the {name} preference dataset"}
        dataset = dataset.map(tokenize, with_indices=True, **map_kwargs)
        if isinstance(dataset, IterableDataset):
            return dataset
        n = len(dataset)
        identical = int(sum(dataset["identical"]))
        truncated = int(sum(dataset["truncated"]))
        if identical:
            logger.warning("%d of %d %s pairs have identical chosen and rejected completions: they carry no "
                           "preference signal (counted in data/identical_pairs).", identical, n, name)
        if truncated:
            logger.info("%d of %d %s pairs were truncated to max_length=%s (%s).", truncated, n, name,
                        args.max_length, args.truncation_mode)
        empty = [i for i, (c, r) in enumerate(zip(dataset["chosen_ids"], dataset["rejected_ids"])) if not c or not r]
        if empty:
            logger.warning("dropping %d %s pairs whose prompt alone fills max_length=%s (first: row %d); raise "
                           "max_length or use truncation_mode='keep_end'.", len(empty), name, args.max_length, empty[0])
            keep = sorted(set(range(n)) - set(empty))
            dataset = dataset.select(keep)
        if name == "train":
            self._data_stats = {"data/truncated_ratio": truncated / max(n, 1), "data/identical_pairs": float(identical),
                                "data/dropped_pairs": float(len(empty))}
        return dataset
