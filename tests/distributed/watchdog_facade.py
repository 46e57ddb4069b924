"""Run under `torchrun --nproc_per_node 2`: the role facade's loop on gloo, ending without any call of the user's.

Modes (argv[1]): `return` (two steps, then the script returns: the process group is left at interpreter exit),
`raise` (rank 1's reward function raises `ValueError("facade reward exploded on rank 1")` at step 2, while rank
0 goes on to the step's collectives). argv[2] is `ddp_timeout` in seconds (default 30).
"""

import sys

import torch.distributed as dist

from hf_verl import Trainer
from tests.conftest import build_char_tokenizer
from tests.distributed.parity import count_a, tiny_qwen2


def main(mode: str, timeout: int) -> None:
    tok = build_char_tokenizer()
    calls = []

    def reward(completions, **kwargs):
        calls.append(1)
        if mode == "raise" and dist.get_rank() == 1 and len(calls) == 2:
            raise ValueError("facade reward exploded on rank 1")
        return count_a(completions, **kwargs)

    trainer = Trainer(actor_model=tiny_qwen2(tok), reward_model=reward, tokenizer=tok,
                      config=dict(num_generations=4, max_completion_length=4, learning_rate=1e-3,
                                  use_async_rollout=False, ddp_timeout=timeout))
    for prompts in (["abc"], ["xyz"]):
        trainer.step(trainer.compute_loss(trainer.rollout(prompts)))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 30)
