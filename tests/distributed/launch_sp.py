"""`tests/distributed/parity.py` with the sequence-parallel degree left to the accelerate launch.

Run under `accelerate launch --config_file configs/accelerate/sp2_cpu.yaml -m tests.distributed.launch_sp ALGO OUT`
(GRPO, PPO or DPO): the training configs do not set `sequence_parallel_size`, so a run with sp=2 can only have
taken it from the config's `parallelism_config` sp_size. parity.py sizes each process's batch by the degree (its
PARITY_SP); it is given the launch's here, so that the global batch is the single-process baseline's.
"""

import os
import sys

os.environ["PARITY_SP"] = os.environ.get("PARALLELISM_CONFIG_SP_SIZE", "1")  # read by parity at import

from tests.distributed import parity  # noqa: E402

_parity_common = parity.common


def common(out, world):
    """parity's training arguments without `sequence_parallel_size`: the launch is the only source of the degree."""
    kwargs = _parity_common(out, world)
    kwargs.pop("sequence_parallel_size", None)
    return kwargs


parity.common = common

if __name__ == "__main__":
    from hf_verl.parallel.comm import leave_together

    parity.main(sys.argv[1], sys.argv[2])
    leave_together()
