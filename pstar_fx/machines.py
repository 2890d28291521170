"""machines: what the cost model knows of a machine. `Machine` holds one GPU's rates, its share of the host and
the network between GPUs (bytes and FLOPs per second), and the sizes a plan is checked against (device memory per
GPU, host memory per node, GPUs per node); `preset` builds a node of a known GPU (`GPU`). Read by the cost model
(cost.py, which re-exports these names: `pstar_fx.cost.Machine` is their documented home), the planner and px.plan.
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from .units import format_bytes, parse_bytes

INF = float("inf")
GiB = 1 << 30


# Machine fields that are fractions of 1
_FRACTIONS = ("cpu_adam_under_copies", "cpu_adam_beside_backward", "cpu_adam_beside_fused", "fused_fraction",
              "attention_efficiency", "flash_attention_efficiency", "efficient_attention_efficiency")


@dataclass(frozen=True)
class Machine:
    """Rates of one GPU, its share of the host, and the network between GPUs. Bytes and FLOPs per second."""
    # measured on one H200 (docs/measurements.md)
    matmul_flops: float = 752e12         # bf16 matmul 8192^3
    hbm_bytes: float = 4.2e12            # device-to-device copy, bytes read + written per second
    h2d_bytes: float = 55e9              # pinned host->device, alone
    d2h_bytes: float = 55e9              # pinned device->host, alone
    duplex_bytes: float = 88e9           # both directions at once, the two together
    duplex_cpu_bytes: float = 74e9       # both directions at once while the CPU runs AdamW, the two together
    cpu_adam: float = 4.1e9              # parameters per second, torch's fused CPU AdamW, fp32 (3.85-4.40 measured)
    cpu_adam_mixed: float = 2.48e9       # the same with the bf16 gradient converted in, the bf16 parameter out
    # pstar-fx's one-pass update of exact Adam moments in mixed precision (runtime/native/adam.c) against torch's
    # three-pass route above, where the host runs it (`native_update`: its C compiler built the kernel). Measured on
    # the 17.26B GPT's atomic step at one plan (42 chunks streamed), H200 machine, 2026-12-06: the CPU worker 33.6-38.4
    # ms an update against 54.9 ms by torch's route (1.43-1.63x; benchmarks/results/gpt17b_native_h200_2026-12-06.md);
    # on the 2-core CI machine, alone, 1.52-1.54x (benchmarks/results/native_update_h200_2026-12-06.md). The
    # fractions below (beside backward, beside a fused step) were fitted with torch's route; not yet measured on it
    native_exact_speedup: float = 1.5
    native_update: bool = True           # the host updates exact mixed-precision moments by the native kernel
    cpu_adam_under_copies: float = 2.7 / 4.1   # CPU AdamW's rate while copies run, as a fraction of its rate alone
    # fitted to the 17.26B GPT's atomic=False step at the default budget (8fba29b, 4.183 s measured, the CPU worker
    # 47 ms an update: benchmarks/results/gpt17b_default_budget_rows_h200.md; planned on the CPU: 3.785 s without
    # it, 4.195 s with it): the CPU's updates during
    # backward, beside the executor issuing the step, run at this fraction of the rates above (an atomic step's
    # updates after the commit ran as modelled: 55 ms an update under copies measured, 56 ms modelled)
    cpu_adam_beside_backward: float = 0.9
    # fitted to the 10.34B GPT's atomic=False step on two H100 machines, fused against unfused in one call each
    # (benchmarks/results/fused_cpu_updates_h100_2026-12-05.md: the CPU worker 35.2 against 27.6 ms an update, and
    # 56.5 against 42.3; the 17.26B GPT's on the H200, 56 against 47, with Inductor's static launcher): beside a
    # fused step's backward (atomic=False) the CPU's updates run at this fraction of the rates above, for a cause
    # not established (not Inductor's compile workers, none of which ran during the steps). After the commit (the
    # atomic step) they ran as modelled: the fused 17.26B GPT's 55 ms an update, 56 modelled
    cpu_adam_beside_fused: float = 0.77
    gpu_adam: float = 123e9              # parameters per second, torch's fused AdamW on the GPU
    # ASSUMED: bytes per second the CPU worker copies in host memory (an undo buffer's copy of a chunk's states), the
    # rate cpu_adam_mixed would give at the ratio measured on a 2-core CI machine (a 402 MB state buffer copied in
    # 58.9 ms, a 33.6M-element mixed update in 64.5 ms, one thread: 13 bytes copied per element updated)
    host_copy_bytes: float = 32e9
    # fitted (least squares) to the three compute-bound steps measured on the H200 (BENCHMARKS.md):
    # GPT 1.3B at 8 x 2048 tokens (pstar-fx unlimited 0.2997 s; model 0.290 s), 1.3B at 4 x 2048 (eager
    # 0.149-0.154 s; model 0.169 s), 4.24B at 4 x 2048 (eager 0.417-0.426 s; model 0.412 s)
    kernel_s: float = 20e-6              # per kernel, beyond its FLOPs or bytes (launch gaps, small-kernel tails)
    # fitted to two fused steps against their unfused runs (BENCHMARKS.md: the Llama-2-13B shape at 8 x 2048 tokens,
    # 3.941 s fused against 4.034 s, a ratio of 0.977; the GPT 6.66B, 0.652 against 0.674-0.676 s, 0.965-0.967;
    # modelled 0.968 and 0.968): a fused region's non-matmul work moves this fraction of the bytes its unfused
    # kernels move (their launches become one)
    fused_fraction: float = 0.9
    # attention kernels' FLOP rates (forward and backward together, causal, bf16) as fractions of matmul_flops,
    # measured at the benchmarks' shapes (8 x 16 and 8 x 40 heads of 128, 2048 tokens; benchmarks/attention_kernels.py):
    # cuDNN's 443-466 TFLOP/s, flash 234-246, memory-efficient 114-118. attention_efficiency is the kernel torch
    # picks on the machine by default (cuDNN's on the H200 with torch 2.11 and CUDA 13), and the rate of attention
    # traced on the CPU (px.plan's default device)
    attention_efficiency: float = 0.6
    flash_attention_efficiency: float = 0.32
    efficient_attention_efficiency: float = 0.15
    # ASSUMED, not measured here
    fp32_matmul_flops: float = 60e12     # fp32 without TF32 (torch's default): the H200 data sheet's 67, rounded down
    host_node_s: float = 10e-6           # the executor's Python per node
    launch_queue: int = 1024             # kernels the host may launch ahead of the compute stream before a launch
    #                                      blocks (CUDA's queue of pending work; "Command Buffer Full" in a profile)
    nvlink_bus_bytes: float = 370e9      # NCCL all-gather / reduce-scatter bus bandwidth among the GPUs of one node
    #                                      (NVLink 4 with NVSwitch; a typical nccl-tests figure for 8 H100/H200)
    network_bus_bytes: float = 360e9     # the same across nodes: 8 x 400 Gb/s NICs per node, one per GPU
    #                                      (rail-optimised; rings spread over the NICs), at 90% of line rate
    collective_latency_s: float = 50e-6  # per collective, beyond its bytes
    gpus_per_node: int = 8
    disk_read_bytes: float = 2.3e9       # the disk tier (offload_dir): the lent H200 machine's disk, direct I/O in
    disk_write_bytes: float = 2.0e9      # 16 MiB blocks (dd, BENCHMARKS.md); a local NVMe drive does 2-3x more
    # sizes px.plan checks a plan against (None: not given, not checked); bytes, or strings such as "1.5TB"
    device_memory: int | None = None     # one GPU's memory, as torch reports its total
    host_memory: int | None = None       # host memory of one node, shared by its GPUs
    name: str = "H200"                   # what the report calls the GPU

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in ("device_memory", "host_memory"):
                if v is not None:
                    try:
                        object.__setattr__(self, f.name, parse_bytes(v))
                    except (TypeError, ValueError) as e:
                        raise ValueError(f"Machine.{f.name} must be bytes or a size such as '1.5TB', or None: "
                                         f"{e}") from None
            elif f.name in ("gpus_per_node", "launch_queue"):
                if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                    raise ValueError(f"Machine.{f.name} must be an integer >= 1, got {v!r}")
            elif f.name == "native_update":
                if not isinstance(v, bool):
                    raise ValueError(f"Machine.native_update must be True or False, got {v!r}")
            elif f.name == "name":
                if not isinstance(v, str):
                    raise ValueError(f"Machine.name must be a string, got {v!r}")
            elif (not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v < INF
                  or (f.name in _FRACTIONS and v > 1)):
                raise ValueError(f"Machine.{f.name} must be a positive finite number"
                                 f"{' at most 1' if f.name in _FRACTIONS else ''}, got {v!r}")

    def bus_bytes(self, world: int) -> float:
        """NCCL bus bandwidth of a collective over `world` ranks (a ring: each rank sends (w-1)/w of the buffer)."""
        return self.nvlink_bus_bytes if world <= self.gpus_per_node else min(self.nvlink_bus_bytes,
                                                                              self.network_bus_bytes)

    def with_pcie(self, bytes_per_s: float) -> Machine:
        """This machine with host->device copies at `bytes_per_s` alone; device->host and the both-ways rates
        scaled by the same factor (the measured ratios between them kept)."""
        if not isinstance(bytes_per_s, (int, float)) or isinstance(bytes_per_s, bool) or not 0 < bytes_per_s < INF:
            raise ValueError(f"a PCIe rate must be positive bytes per second, got {bytes_per_s!r}")
        f = bytes_per_s / self.h2d_bytes
        return dataclasses.replace(self, h2d_bytes=float(bytes_per_s), d2h_bytes=self.d2h_bytes * f,
                                   duplex_bytes=self.duplex_bytes * f, duplex_cpu_bytes=self.duplex_cpu_bytes * f)

    def with_cpu_adam(self, params_per_s: float) -> Machine:
        """This machine with the host's fp32 AdamW at `params_per_s` per GPU; the mixed-precision rate and the host's
        copy rate scaled by the same factor."""
        if not isinstance(params_per_s, (int, float)) or isinstance(params_per_s, bool) or not 0 < params_per_s < INF:
            raise ValueError(f"a CPU update rate must be positive parameters per second, got {params_per_s!r}")
        f = params_per_s / self.cpu_adam
        return dataclasses.replace(self, cpu_adam=float(params_per_s), cpu_adam_mixed=self.cpu_adam_mixed * f,
                                   host_copy_bytes=self.host_copy_bytes * f)

    def describe(self) -> str:
        """One line: the GPU, how many per node, their memory and the node's host memory (and where the hosts update
        exact mixed-precision moments by torch's route, not the native kernel, that)."""
        dev = "memory not given" if self.device_memory is None else format_bytes(self.device_memory)
        host = ("host memory not given" if self.host_memory is None
                else f"{format_bytes(self.host_memory)} of host memory per node")
        return f"{self.gpus_per_node} x {self.name} ({dev}) per node, {host}{self.host_route}"

    @property
    def host_route(self) -> str:
        """What the reports add to the machine's name where its hosts update exact mixed-precision moments by
        torch's route, not the native kernel ("" where they use the kernel)."""
        return "" if self.native_update else ", host updates by torch's route (not the native kernel)"


H200 = Machine()       # the H200 machine's rates; no sizes (px.plan's budgets are then the caller's)


class GPU(enum.Enum):
    """The GPUs `preset` knows."""
    H200 = "h200"
    H100 = "h100"


# One GPU of each kind and its share of the host. The H200's rates and memory were measured (docs/measurements.md);
# the H100's are ASSUMED: the same GH100 die and clocks as the H200 (so its matmul rate), 3.35 of the H200's 4.8 TB/s
# HBM (its memory-bound rates scaled by 3.35 / 4.8), the same PCIe 5 x16 link, NVLink 4 and host share (copy and CPU
# rates).
_GPUS: Mapping[GPU, Machine] = MappingProxyType({
    GPU.H200: dataclasses.replace(H200, device_memory=int(139.8 * GiB), name="H200"),   # torch's total, measured
    GPU.H100: dataclasses.replace(H200, hbm_bytes=H200.hbm_bytes * 3.35 / 4.8, gpu_adam=H200.gpu_adam * 3.35 / 4.8,
                                  device_memory=int(79.1 * GiB), name="H100"),   # 80 GB as torch reports it, assumed
})


def gpu_named(name: str) -> GPU | None:
    """The preset GPU a device's name is (`torch.cuda.get_device_name`, e.g. "NVIDIA H100 80GB HBM3"), or None for a
    GPU the cost model has no rates of (the PCIe and NVL H100s: other clocks and memory than the SXM part's)."""
    words = name.upper().replace("-", " ").split()
    if "PCIE" in words or "NVL" in words:
        return None
    return next((g for g in GPU if g.name in words), None)


def preset(gpu: str | GPU, *, gpus_per_node: int = 8, host_memory: int | str | None = None) -> Machine:
    """A node of `gpus_per_node` GPUs of one kind ("h200", "h100") with `host_memory` bytes of host memory (or a
    size such as "1.5TB"; None: not checked). Every GPU is assumed to get what one GPU of the measured H200 machine
    got: its own PCIe 5 x16 link, 16 host cores for its updates, its share of host memory bandwidth."""
    try:
        kind = GPU(gpu.lower() if isinstance(gpu, str) else gpu)
    except ValueError:
        raise ValueError(f"unknown machine {gpu!r}: use one of {', '.join(repr(g.value) for g in GPU)}, or pass a "
                         "pstar_fx.cost.Machine with the rates and sizes of yours") from None
    return dataclasses.replace(_GPUS[kind], gpus_per_node=gpus_per_node, host_memory=host_memory)
