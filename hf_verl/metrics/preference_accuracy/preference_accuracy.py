"""Preference accuracy as an `evaluate` metric: the share of pairs whose chosen score beats the rejected one."""

import datasets
import evaluate

_DESCRIPTION = """Share of preference pairs ranked right: `chosen_score > rejected_score` (a tie counts as wrong).
Inputs are per-pair scores, e.g. DPO implicit rewards or reward-model scores."""


class PreferenceAccuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description="chosen_scores: list of float; rejected_scores: list of float",
            features=datasets.Features({"chosen_scores": datasets.Value("float64"),
                                        "rejected_scores": datasets.Value("float64")}),
        )

    def _compute(self, chosen_scores, rejected_scores):
        pairs = list(zip(chosen_scores, rejected_scores))
        if not pairs:
            raise ValueError("preference_accuracy needs at least one (chosen, rejected) pair.")
        return {"preference_accuracy": sum(c > r for c, r in pairs) / len(pairs)}
