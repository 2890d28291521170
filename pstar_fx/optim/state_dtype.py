"""How the optimizer's moments are stored: `state_dtype` of px.Adam / px.AdamW.

- FP32 (the default): exact, as torch.optim keeps them.
- BF16: m and v in bfloat16, written with stochastic rounding (4 bytes per parameter instead of 8).
- INT8: m and v block-wise quantised, one fp32 scale per block of INT8_BLOCK elements (about 2 bytes per parameter).

The fp32 master of mixed precision and the 0-d states (the step count) stay fp32 in every case. The quantisers and
the update that runs on them are in pstar_fx/runtime/quantize.py; docs/memory.md says how they round and why.
"""
from __future__ import annotations

from enum import Enum


class StateDtype(Enum):
    FP32 = "fp32"
    BF16 = "bf16"
    INT8 = "int8"

    @property
    def vector_bytes(self) -> int:
        """Bytes per element of one moment, scales aside."""
        return {StateDtype.FP32: 4, StateDtype.BF16: 2, StateDtype.INT8: 1}[self]

    @property
    def compressed(self) -> bool:
        return self is not StateDtype.FP32


# elements per int8 block (one fp32 scale each: 4 / 256 bytes per element per moment). Small blocks keep an outlier
# from flattening the codes of many elements; 256 is what 8-bit optimizers use for their block-wise codes.
INT8_BLOCK = 256

# a compressed update runs block by block: each block of at most SCRATCH_BLOCK elements (a multiple of INT8_BLOCK) is
# dequantised into fp32 scratch, updated and quantised back. Its scratch holds SCRATCH_FLOATS 4-byte values per
# element (m, v, two fp32 and two int32 temporaries); on the device it is the step's workspace, counted by the plan.
SCRATCH_BLOCK = 1 << 20
SCRATCH_FLOATS = 6


def scratch_bytes(numel: int, dtype: StateDtype) -> int:
    """Bytes of a compressed update's scratch for a chunk (shard) of `numel` elements; 0 for FP32."""
    return SCRATCH_FLOATS * 4 * min(numel, SCRATCH_BLOCK) if dtype.compressed else 0


# an update's time per element relative to exact fp32 Adam's, for the cost model: on the CPU (UPDATE_COST) the native
# one-pass kernel (pstar_fx/runtime/native/adam.c), on the GPU (DEVICE_UPDATE_COST) its Triton twin
# (pstar_fx/runtime/device_adam.py). Measured with benchmarks/state_update_rate.py on the H200 machine: the host's 16
# threads, mixed precision, a 16.8M-element chunk (fp32 3.87, bf16 5.61, int8 2.64 Gparam/s); the GPU, fp32
# parameters, a 100.7M-element chunk (--device cuda: fp32 109, bf16 142, int8 105 Gparam/s).
UPDATE_COST = {StateDtype.FP32: 1.0, StateDtype.BF16: 0.69, StateDtype.INT8: 1.47}
DEVICE_UPDATE_COST = {StateDtype.FP32: 1.0, StateDtype.BF16: 0.77, StateDtype.INT8: 1.05}


def parse_state_dtype(value, where: str) -> StateDtype:
    """The user's form ("fp32", "bf16", "int8", or the enum) as a StateDtype; anything else is a ValueError."""
    if isinstance(value, StateDtype):
        return value
    choices = ", ".join(repr(d.value) for d in StateDtype)
    if isinstance(value, str):
        for d in StateDtype:
            if value.lower() == d.value:
                return d
    raise ValueError(f"{where}: state_dtype must be one of {choices}, got {value!r}")
