"""The facade's rows: a user's batch in any of the forms `rollout()` takes, and the rows drawn from its dataset.

`rollout(batch)` takes a list of prompt strings, a list of chat-message lists, a dict of lists with a `prompt` key
(a `DataLoader` batch over a `datasets.Dataset`; the other keys reach the reward functions), or a list of row
dicts; :func:`batch_rows` turns each into rows (`prompt` and the other columns), each repeated `num_generations`
times, groups contiguous. `rollout()` without a batch draws from the facade's dataset through
:class:`DatasetRows`: a seeded order per epoch, every data-parallel rank taking its share of each draw.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from hf_verl.data.prompts import check_prompt_column


def batch_rows(batch: Any, num_generations: int) -> list[dict]:
    """`batch` as rows (`prompt` and the other columns), each repeated `num_generations` times.

    Raises:
        ValueError: a batch of none of the accepted forms, or a dict without a `prompt` key.
    """
    if isinstance(batch, Mapping):
        check_prompt_column(list(batch))
        columns = {k: (v.tolist() if isinstance(v, torch.Tensor) else list(v)) for k, v in batch.items()}
        prompts = columns.pop("prompt")
    elif isinstance(batch, Sequence) and not isinstance(batch, str) and batch and all(
            isinstance(r, Mapping) and "prompt" in r for r in batch):
        prompts = [r["prompt"] for r in batch]
        columns = {k: [r.get(k) for r in batch] for k in batch[0] if k != "prompt"}
    elif isinstance(batch, Sequence) and not isinstance(batch, str) and batch:
        prompts, columns = list(batch), {}
    else:
        raise ValueError(f"rollout() needs a non-empty list of prompts, a dict with a 'prompt' key, or None "
                         f"with a dataset; got {type(batch).__name__}.")
    return [{"prompt": p, **{k: v[i] for k, v in columns.items()}}
            for i, p in enumerate(prompts) for _ in range(num_generations)]


class DatasetRows:
    """Rows drawn from a dataset in a seeded order (a new permutation, seeded by `seed + epoch`, each epoch)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self._order: list[int] = []
        self._epoch = 0

    def draw(self, n: int, seed: int, dp_rank: int, dp_size: int) -> list[dict]:
        """This data-parallel rank's `n` rows of the next `n x dp_size` of the order.

        Raises:
            ValueError: there is no dataset to draw from.
        """
        if self.dataset is None:
            raise ValueError("rollout() was called without a batch and the Trainer has no dataset.")
        rows = []
        while len(rows) < n * dp_size:
            if not self._order:
                g = torch.Generator().manual_seed(seed + self._epoch)
                self._order = torch.randperm(len(self.dataset), generator=g).tolist()
                self._epoch += 1
            rows.append(self._order.pop())
        mine = rows[dp_rank * n : (dp_rank + 1) * n]
        return [dict(self.dataset[i]) for i in mine]
