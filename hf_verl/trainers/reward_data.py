"""The reward trainer's data: preference rows as two whole token sequences each, on the preparation the preference
trainers share (:mod:`hf_verl.trainers.preference_data`). Mixed into
:class:`~hf_verl.trainers.reward_trainer.RewardTrainer`.

Every TRL preference format is read (explicit or implicit prompt, standard or conversational, per-row `tools` and
`chat_template_kwargs`): a row becomes `chosen_ids` / `rejected_ids`, each the whole of prompt + answer, rendered
as DPO renders it (:func:`~hf_verl.data.preference.tokenize_sequences`). A dataset holding `chosen_ids` /
`rejected_ids` is used as it is (TRL's older names `chosen_input_ids` / `rejected_input_ids` are renamed, with a
deprecation warning as in TRL). A `margin` column rides along to the loss. As TRL does, a pair whose chosen or
rejected sequence is longer than `max_length` is dropped rather than truncated (the score is read at the last
token, which truncation would cut off); the count is logged.
"""

from __future__ import annotations

import functools
import logging
import warnings

from hf_verl.data.preference import tokenize_sequences
from hf_verl.trainers.preference_data import (
    PreferenceData,
    dataset_columns,
    is_streaming,
)
from hf_verl.trainers.reward_config import RewardConfig

logger = logging.getLogger(__name__)

TOKEN_COLUMNS = ("chosen_ids", "rejected_ids")
LEGACY_COLUMNS = ("chosen_input_ids", "rejected_input_ids")


def _tokenize_row(row: dict, index: int, *, tokenizer) -> dict:
    chosen, rejected = tokenize_sequences(row, tokenizer, index)
    return {"chosen_ids": chosen, "rejected_ids": rejected}


def _fits(row: dict, max_length: int) -> bool:
    return len(row["chosen_ids"]) <= max_length and len(row["rejected_ids"]) <= max_length


class RewardData(PreferenceData):
    """Tokenising, renaming and filtering the reward trainer's datasets (see the module docstring)."""

    _token_columns = TOKEN_COLUMNS
    _needs = ("'chosen' and 'rejected' (and optionally 'prompt' and 'margin'), or the token columns 'chosen_ids' "
              "and 'rejected_ids'")

    def _prepare_dataset(self, dataset, tokenizer, args: RewardConfig, name: str):
        if dataset is not None:
            columns = dataset_columns(dataset)
            if all(c in columns for c in LEGACY_COLUMNS) and not all(c in columns for c in TOKEN_COLUMNS):
                warnings.warn("the columns chosen_input_ids / rejected_input_ids are deprecated (TRL: they will not be "
                              "supported in v1); they are read as chosen_ids / rejected_ids. Rename them in the "
                              "dataset.", FutureWarning, stacklevel=3)
                for old, new in zip(LEGACY_COLUMNS, TOKEN_COLUMNS):
                    dataset = dataset.rename_column(old, new)
        return super()._prepare_dataset(dataset, tokenizer, args, name)

    def _row_tokenizer(self, tokenizer, args: RewardConfig):
        return functools.partial(_tokenize_row, tokenizer=tokenizer)

    def _after_tokenizing(self, dataset, args: RewardConfig, name: str, *, tokenized_here: bool):
        """Pairs longer than `max_length` dropped (counted in the log for a map-style dataset)."""
        if args.max_length is None:
            return dataset
        fits = functools.partial(_fits, max_length=args.max_length)
        before = None if is_streaming(dataset) else len(dataset)
        dataset = dataset.filter(fits, **self._map_kwargs(dataset, args, f"Dropping {name} pairs over "
                                                                          f"{args.max_length} tokens"))
        if before is not None and len(dataset) < before:
            logger.warning("dropped %d of %d %s pairs whose chosen or rejected sequence is longer than max_length=%d "
                           "(a reward model scores the last token: pairs are not truncated).", before - len(dataset),
                           before, name, args.max_length)
            if len(dataset) == 0:
                raise ValueError(f"every {name} pair is longer than max_length={args.max_length} tokens: raise "
                                 "max_length or set it to None.")
        return dataset
