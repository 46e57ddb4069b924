"""The LM head's chunk size capped by bytes: peak memory and time of one log-prob forward + backward.

`hf_verl.algorithms.logprobs.logprobs_from_head` walks the positions `chunk_size` (1024) at a time and, since
the byte cap, never lets one chunk's fp32 logits exceed `MAX_CHUNK_BYTES` (256 MiB): a 152k vocabulary gets
441 positions a chunk, a vocabulary up to 64k keeps 1024 (the control rows below). For each configuration
(vocabulary, hidden width, positions) a fresh subprocess runs the head's log-probs, entropy (optional) and
backward with the cap and without it (`max_chunk_bytes` unbounded, the code before the cap), interleaved pair
by pair; each line prints the median peak-RSS growth over the run's start, the median milliseconds per
forward+backward and the ratios cap / no cap. Measure on a quiet machine.

Usage: python benchmarks/logprob_chunks.py [--pairs 3] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import current_rss_mib, peak_rss_mib

# (vocabulary, hidden width, positions, with entropy)
CONFIGS = [
    (32_000, 256, 4096, False),  # control: the cap does not bind below 64k words
    (151_936, 256, 4096, False),
    (151_936, 896, 2048, False),
    (151_936, 896, 8192, False),
    (151_936, 896, 4096, True),  # GRPO/PPO score entropy as well
]


def child(vocab: int, hidden: int, positions: int, entropy: bool, capped: bool, rounds: int) -> None:
    import torch

    from hf_verl.algorithms.logprobs import MAX_CHUNK_BYTES, logprobs_from_head

    torch.manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    h = torch.randn(positions, hidden, requires_grad=True)
    targets = torch.randint(0, vocab, (positions,))
    rss0 = current_rss_mib()
    times = []
    for _ in range(rounds + 1):  # the first round warms up
        t0 = time.perf_counter()
        logp, ent, _ = logprobs_from_head(h, head, targets, with_entropy=entropy,
                                          max_chunk_bytes=MAX_CHUNK_BYTES if capped else 2**62)
        loss = logp.sum() + (ent.sum() if entropy else 0)
        loss.backward()
        times.append(time.perf_counter() - t0)
        head.weight.grad = h.grad = None
    print(json.dumps({"peak_growth_mib": peak_rss_mib() - rss0, "ms": 1e3 * statistics.median(times[1:])}))


def spawn(config, capped: bool, rounds: int) -> dict:
    vocab, hidden, positions, entropy = config
    cmd = [sys.executable, __file__, "--child", f"{vocab},{hidden},{positions},{int(entropy)},{int(capped)}",
           "--rounds", str(rounds)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"{config} capped={capped} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3, help="timed forward+backward rounds per run")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        vocab, hidden, positions, entropy, capped = (int(x) for x in a.child.split(","))
        child(vocab, hidden, positions, bool(entropy), bool(capped), a.rounds)
        return
    from hf_verl.algorithms.logprobs import chunk_positions

    for config in CONFIGS:
        runs = {True: [], False: []}
        for i in range(a.pairs):
            for capped in ((True, False) if i % 2 == 0 else (False, True)):
                runs[capped].append(spawn(config, capped, a.rounds))
        mem = [c["peak_growth_mib"] / u["peak_growth_mib"] for c, u in zip(runs[True], runs[False])]
        speed = [u["ms"] / c["ms"] for c, u in zip(runs[True], runs[False])]
        vocab, hidden, positions, entropy = config
        med = {k: {m: statistics.median(r[m] for r in v) for m in ("peak_growth_mib", "ms")} for k, v in runs.items()}
        print(f"V={vocab} H={hidden} N={positions} entropy={entropy} chunk={chunk_positions(1024, vocab)}: "
              f"peak growth {med[True]['peak_growth_mib']:.0f} vs {med[False]['peak_growth_mib']:.0f} MiB "
              f"(x{statistics.median(mem):.2f}), {med[True]['ms']:.0f} vs {med[False]['ms']:.0f} ms "
              f"(speed x{statistics.median(speed):.2f}, pairs {', '.join(f'{x:.2f}' for x in speed)})", flush=True)


if __name__ == "__main__":
    main()
