"""DPO's preference data: each row tokenised into a pair (prompt, chosen, rejected; truncation, identical and dropped
pairs counted), on the preparation the preference trainers share (:mod:`hf_verl.trainers.preference_data`), and
the refusal of streaming datasets with precomputed reference log-probs. Mixed into
:class:`~hf_verl.trainers.dpo_trainer.DPOTrainer`."""

from __future__ import annotations

import functools
import logging

from hf_verl.data.preference import tokenize_pair
from hf_verl.data.vision import tokenize_vision_pair
from hf_verl.trainers.dpo_config import DPOConfig
from hf_verl.trainers.preference_data import (
    PreferenceData,
    is_streaming,
    preference_accuracy,
)

__all__ = ["TOKEN_COLUMNS", "DPOData", "preference_accuracy"]

logger = logging.getLogger(__name__)

TOKEN_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")


def _tokenize_row(row: dict, index: int, *, tokenizer, max_length: int | None, truncation_mode: str) -> dict:
    pair = tokenize_pair(row, tokenizer, max_length, truncation_mode, index=index)
    return {"prompt_ids": pair.prompt_ids, "chosen_ids": pair.chosen_ids, "rejected_ids": pair.rejected_ids,
            "truncated": pair.truncated, "identical": pair.identical}


def _tokenize_vision_row(row: dict, index: int, *, processor, max_length: int | None) -> dict:
    return tokenize_vision_pair(row, processor, max_length, index=index)


class DPOData(PreferenceData):
    """Tokenising and checking DPO's datasets (see the module docstring)."""

    _token_columns = TOKEN_COLUMNS

    def _check_dataset(self, dataset, args: DPOConfig, name: str) -> None:
        if is_streaming(dataset) and args.precompute_ref_log_probs:
            raise ValueError(
                f"precompute_ref_log_probs=True is not supported with IterableDataset (the {name} dataset): the "
                "log-probs are stored as columns of a map-style dataset. Load it without streaming, or set "
                "precompute_ref_log_probs=False."
            )

    def _row_tokenizer(self, tokenizer, args: DPOConfig):
        if getattr(self, "_processor", None) is not None:  # pairs with images: tokenised with them by the processor
            return functools.partial(_tokenize_vision_row, processor=self._processor, max_length=args.max_length)
        return functools.partial(_tokenize_row, tokenizer=tokenizer, max_length=args.max_length,
                                 truncation_mode=args.truncation_mode)

    def _after_tokenizing(self, dataset, args: DPOConfig, name: str, *, tokenized_here: bool):
        """Counts of identical and truncated pairs (logged; the train split's as `data/*` metrics), and the pairs
        whose prompt alone fills `max_length` dropped."""
        if not tokenized_here or is_streaming(dataset):
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
        if empty and len(empty) == n:
            raise ValueError(f"every {name} pair's prompt alone fills max_length={args.max_length}, which would leave "
                             "no completion token to train on: raise max_length (or set it to None).")
        if empty:
            logger.warning("dropping %d %s pairs whose prompt alone fills max_length=%s (first: row %d); raise "
                           "max_length or use truncation_mode='keep_end'.", len(empty), name, args.max_length, empty[0])
            keep = sorted(set(range(n)) - set(empty))
            dataset = dataset.select(keep)
        if name == "train":
            self._data_stats = {"data/truncated_ratio": truncated / max(n, 1), "data/identical_pairs": float(identical),
                                "data/dropped_pairs": float(len(empty))}
        return dataset
