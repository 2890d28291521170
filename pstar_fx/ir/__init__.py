"""The IR every stage shares: `TrainGraph` and its typed tables (graph), the operations the passes insert (ops), what
each node needs on the device (needs), the printer (printing) and small fx helpers (fx_utils).

The names of `graph` are re-exported here (`from pstar_fx.ir import TrainGraph, Role`).
"""
from .graph import (REMAT, USER_CHECKPOINT, BufferInfo, BufKind, Choice, ChunkGroup, ChunkInfo, InputInfo, MemoryPlan,
                    NodeAnn, ParamHome, ParamInfo, Phase, Precision, RematTag, Role, Scheduled, Settings, StateHome,
                    TrainGraph, UserCheckpointTag, copy_graph, to_module)

__all__ = ["REMAT", "USER_CHECKPOINT", "BufferInfo", "BufKind", "Choice", "ChunkGroup", "ChunkInfo", "InputInfo",
           "MemoryPlan", "NodeAnn", "ParamHome", "ParamInfo", "Phase", "Precision", "RematTag", "Role", "Scheduled",
           "Settings", "StateHome", "TrainGraph", "UserCheckpointTag", "copy_graph", "to_module"]
