"""The analytical step-time model: seconds per optimizer step of one layout, from the compute and the bytes each
collective moves, on a stated :class:`Hardware`.

Per optimizer step of a data-parallel replica's `tokens`:

- **compute**: `6 x parameters x tokens` FLOPs (forward 2, backward 4), `8 x` with activation checkpointing (the
  forward again), plus causal attention's `6 x layers x seq x q_dim x tokens`; split over tp x pp x sp ranks, run
  at `flops x mfu`; a Mixture-of-Experts model counts its active parameters (the routed experts a token goes to),
  not its total;
- **DDP**: one all-reduce of the gradients per step (accumulation under `no_sync`): `2 (n-1)/n x bytes`;
- **ZeRO-1/2**: a reduce-scatter of the gradients and an all-gather of the updated weights per step;
- **FSDP2 / ZeRO-3**: an all-gather of the weights in the forward and again in the backward of every micro-batch,
  and a reduce-scatter of the gradients per step;
- **tensor parallel**: two all-reduces of a micro-batch's activations per layer in the forward and two in the
  backward (Megatron's column / row pairs);
- **Ulysses SP**: four all-to-alls per layer in the forward (q, k, v, output) and four in the backward, each moving
  `(n-1)/n` of the local activations;
- **expert parallel** (MoE, `ep` > 1): the token dispatcher's all-to-all, twice per MoE layer in the forward
  (dispatch to the experts' ranks, combine back) and twice in the backward, each moving `(ep-1)/ep` of the
  micro-batch's `tokens x experts_per_token x hidden` activations; the experts' gradients are reduced over the
  expert-data-parallel ranks (dp / ep) only;
- **pipeline**: the 1F1B bubble, `(pp - 1) / (micro-batches + pp - 1)` of the compute, and the stage-boundary
  sends;
- **offload**: the gradients to the host and the weights back over PCIe, and the optimizer on the host's CPU.

Collectives within a node use `intra_node_bandwidth`, across nodes `inter_node_bandwidth` (a group spans nodes
when its ranks do: tp innermost, then sp, then dp, then pp). Communication is not assumed to overlap compute
(an upper bound; real runs overlap much of FSDP's gathers): what the model ranks is layouts against each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_verl.planner.architectures import Architecture
from hf_verl.planner.memory import Layout

__all__ = ["Hardware", "StepTime", "step_time", "H100"]


@dataclass(frozen=True)
class Hardware:
    """What the step-time model assumes of a device and its links.

    Args:
        flops (`float`): dense bf16 FLOP/s of one device. mfu (`float`): the fraction reached.
        intra_node_bandwidth / inter_node_bandwidth (`float`): bytes/s per device of a collective's bus bandwidth.
        devices_per_node (`int`). pcie_bandwidth (`float`): host <-> device bytes/s.
        host_adam_params_per_s (`float`): parameters a host CPU updates per second per device (offloaded AdamW).
        name (`str`).
    """

    flops: float = 989e12
    mfu: float = 0.4
    intra_node_bandwidth: float = 300e9
    inter_node_bandwidth: float = 25e9
    devices_per_node: int = 8
    pcie_bandwidth: float = 25e9
    host_adam_params_per_s: float = 1e9
    name: str = "H100 SXM (989 TFLOP/s bf16 at 40% MFU; NVLink 300 GB/s, 25 GB/s per GPU across nodes)"


H100 = Hardware()


@dataclass
class StepTime:
    """Seconds of one optimizer step, by cause.

    Attributes:
        parts (`dict[str, float]`): compute, recompute, each collective kind, bubble, offload.
        tokens (`int`): tokens per optimizer step over the whole launch.
    """

    parts: dict[str, float] = field(default_factory=dict)
    tokens: int = 0

    @property
    def seconds(self) -> float:
        return sum(self.parts.values())

    def __str__(self) -> str:
        big = sorted(((v, k) for k, v in self.parts.items() if v > 0.005 * self.seconds), reverse=True)
        return f"{self.seconds:.2f} s/step (" + ", ".join(f"{k} {v:.2f} s" for v, k in big) + ")"


def _ring(n: int) -> float:
    return (n - 1) / n if n > 1 else 0.0


def step_time(arch: Architecture, layout: Layout, *, seq_len: int, global_rows: int, hw: Hardware = H100,
              trainable: bool = True, act_bytes: int = 2, weight_bytes: int = 2) -> StepTime:
    """Seconds per optimizer step of `layout` for `global_rows` rows of `seq_len` tokens.

    Args:
        arch ([`Architecture`]), layout ([`Layout`]): the model and its layout.
        seq_len (`int`): tokens per row. global_rows (`int`): rows per optimizer step, all ranks together.
        hw ([`Hardware`]): the device model. trainable (`bool`): False for a forward-only role.
        act_bytes / weight_bytes (`int`): bytes per activation / communicated weight element.

    Returns:
        [`StepTime`].
    """
    st = StepTime(tokens=global_rows * seq_len)
    rows_per_replica = max(1, global_rows // layout.dp)
    micro_batches = max(1, rows_per_replica // layout.micro_batch_size)
    tokens = rows_per_replica * seq_len  # one replica's tokens per step
    split = layout.tp * layout.pp * layout.sp
    passes = (6 if trainable else 2)
    dense = 2 * arch.active_params * tokens
    attention = 2 * arch.layers * seq_len * arch.q_dim * tokens
    rate = hw.flops * hw.mfu
    st.parts["compute"] = (dense + attention) * passes / 2 / split / rate
    if trainable and layout.activation_checkpointing:
        st.parts["recompute"] = (dense + attention) / split / rate

    # which links each axis's group spans (tp innermost, then sp, dp, pp)
    def bandwidth(inner: int, size: int) -> float:
        return hw.intra_node_bandwidth if inner * size <= hw.devices_per_node else hw.inter_node_bandwidth

    bw_tp = bandwidth(1, layout.tp)
    bw_sp = bandwidth(layout.tp, layout.sp)
    bw_dp = bandwidth(layout.tp * layout.sp, layout.dp)
    local_params = (arch.params - arch.expert_params * (1 - 1 / layout.ep)) / (layout.tp * layout.pp)
    shard_n = layout.dp * layout.sp if layout.sharding == "fsdp2" else layout.dp  # FSDP2 shards over dp x sp
    if trainable and shard_n > 1:
        grad = local_params * 4
        if layout.sharding == "fsdp2":
            st.parts["reduce-scatter (gradients)"] = _ring(shard_n) * grad / (bw_dp if layout.dp > 1 else bw_sp)
        elif layout.sharding == "none":
            st.parts["all-reduce (gradients)"] = 2 * _ring(layout.dp) * grad / bw_dp
        else:
            st.parts["reduce-scatter (gradients)"] = _ring(layout.dp) * grad / bw_dp
            if layout.sharding in ("zero1", "zero2"):
                st.parts["all-gather (weights)"] = _ring(layout.dp) * local_params * weight_bytes / bw_dp
    if layout.sharding in ("zero3", "fsdp2") and shard_n > 1:
        gathers = (2 if trainable else 1) * micro_batches
        bw = bw_dp if layout.dp > 1 else bw_sp
        st.parts["all-gather (weights)"] = gathers * _ring(shard_n) * local_params * weight_bytes / bw
    if layout.tp > 1:
        per_micro = layout.micro_batch_size * seq_len / layout.sp * arch.hidden * act_bytes
        count = (4 if trainable else 2) * arch.layers / layout.pp
        st.parts["all-reduce (tensor parallel)"] = micro_batches * count * 2 * _ring(layout.tp) * per_micro / bw_tp
    if layout.sp > 1:
        local = layout.micro_batch_size * seq_len / layout.sp * (2 * arch.q_dim + 2 * arch.kv_dim) / layout.tp
        count = (2 if trainable else 1) * arch.layers / layout.pp
        st.parts["all-to-all (sequence parallel)"] = micro_batches * count * _ring(layout.sp) * local * act_bytes / bw_sp
    if layout.ep > 1 and arch.is_moe:
        routed = layout.micro_batch_size * seq_len / layout.sp * arch.experts_per_token * arch.hidden * act_bytes
        count = (4 if trainable else 2) * arch.moe_layers / layout.pp
        bw_ep = bandwidth(layout.tp, layout.ep)
        st.parts["all-to-all (expert dispatch)"] = micro_batches * count * _ring(layout.ep) * routed / bw_ep
    if layout.pp > 1:
        bubble = (layout.pp - 1) / (micro_batches + layout.pp - 1)
        st.parts["pipeline bubble"] = bubble / (1 - bubble) * (st.parts["compute"] + st.parts.get("recompute", 0))
        boundary = layout.micro_batch_size * seq_len / layout.sp * arch.hidden * act_bytes / layout.tp
        st.parts["send/recv (pipeline)"] = micro_batches * (2 if trainable else 1) * boundary / hw.inter_node_bandwidth
    if trainable and (layout.offload_optimizer or layout.offload_params):
        shard = layout.dp if layout.sharding != "none" else 1
        moved = local_params / shard * (4 + weight_bytes)  # gradients out, weights back
        if layout.offload_params:
            moved += local_params / shard * weight_bytes * 2 * micro_batches
        st.parts["offload (PCIe)"] = moved / hw.pcie_bandwidth
        st.parts["host optimizer"] = local_params / shard / hw.host_adam_params_per_s
    return st
