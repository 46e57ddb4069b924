"""Routing replay, measured: a tiny Mixture-of-Experts model whose rollout runs in bf16 (autocast, as a bf16 rollout
engine does) and whose training forward runs in fp32, the way hf_verl runs them (TransformersEngine records the
routing, AccelerateEngine scores the completions).

Prints, for several seeds: the share of (token, layer) pairs and of tokens the training forward routes as the rollout
did, without replay (the routers' own choice) and with replay (the experts the experts modules are handed, read by a
hook on them), and the rollout/train log-prob mismatch on the sampled tokens both ways: mean |dlogp| and the k1 / k3
estimates of KL(rollout || train).

    python benchmarks/router_replay.py [--seeds 0 1 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_verl.engine.registry import RoleLayout, make_engine  # noqa: E402
from hf_verl.moe import RoutingTap  # noqa: E402
from hf_verl.moe.metrics import same_experts  # noqa: E402
from hf_verl.parallel.backend import BackendSpec  # noqa: E402
from hf_verl.parallel.dims import ParallelDims  # noqa: E402
from hf_verl.pipeline.generation import batch_from_output  # noqa: E402
from hf_verl.rollout.base import SamplingParams  # noqa: E402
from hf_verl.rollout.hf_engine import TransformersEngine  # noqa: E402
from tests.conftest import build_char_tokenizer  # noqa: E402
from tests.test_router_replay import moe_model  # noqa: E402

PROMPTS = ["abc", "hello", "xyz", "ab", "hey there", "reverse me", "moe", "q"]


def measure(seed: int, group: int = 4, max_new_tokens: int = 32) -> dict:
    tok = build_char_tokenizer()
    model = moe_model(tok, seed=seed, hidden=64, experts=16, layers=4)
    engine = TransformersEngine(model, tok, autocast_dtype=torch.bfloat16)
    engine.record_routing = True
    prompts = [p for p in PROMPTS for _ in range(group)]
    ids = [tok(p).input_ids for p in prompts]
    out = engine.generate(ids, SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, seed=seed))
    batch = batch_from_output(ids, prompts, out, tok, "cpu")
    actor = make_engine(model, "actor", RoleLayout(BackendSpec(), ParallelDims()), trainable=False)
    tap = RoutingTap.of(model)
    record = batch.routed_experts.reshape(-1, tap.num_layers, tap.top_k).long()
    recorded = (record >= 0).all(-1)  # (N, L)
    handed: list[torch.Tensor] = []
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    hooks = [e.register_forward_pre_hook(lambda mod, args: handed.append(args[1].clone())) for e in experts]
    result = {"seed": seed, "tokens": int(recorded.all(-1).sum()), "layers": tap.num_layers}
    mask = batch.completion_mask.bool()
    try:
        for replay in (False, True):
            handed.clear()
            actor.router_replay = replay
            with torch.no_grad():
                logp, _, _ = actor.logprobs(batch, with_aux_loss=True)
            used = torch.stack(handed, dim=1)  # (N, L, k): what the experts computed with
            alike = same_experts(used, record) & recorded
            key = "replay" if replay else "no_replay"
            result[f"{key}/pairs_alike"] = float(alike.sum() / recorded.sum())
            tokens = recorded.all(-1)
            result[f"{key}/tokens_alike"] = float((alike.all(-1) & tokens).sum() / tokens.sum())
            diff = (batch.sampling_logprobs - logp)[mask]  # log pi_rollout - log pi_train on rollout samples
            result[f"{key}/mean_abs_dlogp"] = float(diff.abs().mean())
            result[f"{key}/kl_k1"] = float(diff.mean())
            result[f"{key}/kl_k3"] = float((torch.exp(-diff) - 1 + diff).mean())
    finally:
        for h in hooks:
            h.remove()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--json", type=str, default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    rows = [measure(s) for s in args.seeds]
    cols = ["pairs_alike", "tokens_alike", "mean_abs_dlogp", "kl_k1", "kl_k3"]
    print("| seed | tokens | " + " | ".join(f"{c} (no replay / replay)" for c in cols) + " |")
    print("|---|---|" + "---|" * len(cols))
    for r in rows:
        cells = [f"{r[f'no_replay/{c}']:.4g} / {r[f'replay/{c}']:.4g}" for c in cols]
        print(f"| {r['seed']} | {r['tokens']} | " + " | ".join(cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
