"""Helpers shared by the benchmarks: a step timer that skips the warm-up step, RSS readings, a reward,
and the tiny Qwen2 policy the trainer benchmarks time."""

import resource
import time
from pathlib import Path

from transformers import TrainerCallback


def tiny_qwen2(tok, **config):
    """A 2-layer Qwen2 (hidden 128) over `tok`'s vocabulary, seeded; `config` adds Qwen2Config fields."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tok),
                                        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, **config))


def count_a(completions, **kwargs):
    """A cheap rule reward: how many 'a' a completion holds."""
    return [float(c.count("a")) for c in completions]


class StepTimer(TrainerCallback):
    """Times steps after a warm-up step, so that one-off set-up is not counted."""

    def __init__(self):
        self.t0, self.steps = None, 0

    def on_step_end(self, args, state, control, **kw):
        import torch

        if torch.cuda.is_available():  # queued kernels belong to the step that launched them
            torch.cuda.synchronize()
        if state.global_step == 1:
            self.t0 = time.perf_counter()
        elif self.t0 is not None:
            self.steps += 1


def json_objects(text: str) -> list:
    """Every JSON object printed in `text`, also where ranks sharing one pipe wrote theirs on the same line."""
    import json

    decoder, found, i = json.JSONDecoder(), [], text.find("{")
    while i != -1:
        try:
            obj, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            i = text.find("{", i + 1)
            continue
        found.append(obj)
        i = text.find("{", end)
    return found


def current_rss_mib():
    """Resident set size now (Linux ``/proc``), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("VmRSS not found in /proc/self/status")


def peak_rss_mib():
    """Peak resident set size of this process so far, in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def median_logprob_ms(model, engines: dict, batch, rounds: int) -> dict:
    """Median milliseconds of each engine's log-prob forward (with entropy) and backward over `batch`, the engines
    interleaved round by round after one warm-up round."""
    import statistics
    import time

    times = {mode: [] for mode in engines}
    for r in range(rounds + 1):
        for mode, engine in engines.items():
            t0 = time.perf_counter()
            logp, _ = engine.logprobs(batch, with_entropy=True)
            logp.sum().backward()
            model.zero_grad(set_to_none=True)
            if r:
                times[mode].append(time.perf_counter() - t0)
    return {mode: statistics.median(ts) * 1e3 for mode, ts in times.items()}
