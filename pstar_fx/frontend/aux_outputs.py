"""What a traced training step returns: the loss, or `(loss, aux)`.

`aux` is any pytree (tuples, lists, dicts and other mappings, such as transformers' `ModelOutput`, returned as
the same class) of tensors and plain constants (int, float, bool, str, None): logits, an accuracy, per-token losses,
a dict of metrics. Its tensors become graph outputs (ir/outputs.py gives their
place), planned like every activation: each lives from the node that computes it to the end of the step. They are
the values of the forward pass, computed with the parameters before the update. The constants are returned as
they are (they are fixed by the trace, like the constants of a batch).

With accumulate=K each aux tensor is stacked over the micro-batches on a new dimension 0: micro-batch k's value is
copied into row k of a (K, *shape) tensor right after its forward, so one micro-batch's aux is live at a time
besides the stack. Its structure and constants must be the same in every micro-batch.

An aux tensor that shares storage with a parameter, a module buffer or a tensor constant is copied where it is made
(after the forward's last write into a buffer): parameters live in chunks that move and are updated in place, and
the step returns the values of its forward pass.
"""
from __future__ import annotations

import functools
from collections import OrderedDict, defaultdict
from collections.abc import Mapping

import optree
import torch
import torch.fx as fx

from ..errors import UntraceableError
from ..ir.fx_utils import mutated_args, storage_key
from ..ir.graph import Role
from ..ir.outputs import TENSOR_LEAF, AuxOutputs

_CONSTANTS = (int, float, bool, str, type(None))

_HOW = ("return the loss (a 0-d floating tensor), or a pair (loss, aux) where aux is a tensor or a tuple, list or "
        "dict of tensors and plain constants, e.g. `return loss, {\"logits\": logits, \"acc\": acc}`")


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    return type(x).__name__


def split_returned(out) -> tuple[torch.Tensor, object, bool]:
    """The loss and aux of what the step function returned, and whether it returned aux at all. The loss's own
    checks (0-d, floating, needs grad) are the tracer's."""
    if isinstance(out, torch.Tensor):
        return out, None, False
    if isinstance(out, (tuple, list)) and len(out) == 2 and isinstance(out[0], torch.Tensor):
        return out[0], out[1], True
    if isinstance(out, (tuple, list)):
        what = (f"a {type(out).__name__} of {len(out)} elements" if len(out) != 2
                else f"a pair whose first element is {_describe(out[0])}")
        raise UntraceableError(f"the step function returned {what}; {_HOW} (pack several outputs into aux: "
                               "`return loss, (a, b)`)")
    raise UntraceableError(f"the step function returned {_describe(out)}; {_HOW}"
                           + (" (a model output object: return its .loss)" if hasattr(out, "loss") else ""))


NAMESPACE = "pstar_fx"     # optree's namespace for the mapping classes below


def _register_mappings(tree) -> None:
    """Register, in pstar-fx's optree namespace, the mapping classes in `tree` that optree does not know (an
    OrderedDict subclass such as transformers' ModelOutput): flattened by key, rebuilt as the same class."""
    stack, seen = [tree], set()
    while stack:
        x = stack.pop()
        if id(x) in seen:            # (a structure that holds itself: optree refuses it below)
            continue
        seen.add(id(x))
        if isinstance(x, Mapping):
            cls = type(x)
            if cls not in (dict, OrderedDict, defaultdict):
                try:
                    optree.register_pytree_node(cls, _flatten_mapping, functools.partial(_rebuild_mapping, cls),
                                                namespace=NAMESPACE)
                except ValueError:          # registered already
                    pass
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)


def _flatten_mapping(m):
    keys = list(m.keys())
    return [m[k] for k in keys], tuple(keys), keys


def _rebuild_mapping(cls, keys, values):
    items = dict(zip(keys, values))
    try:
        return cls(**items)             # a ModelOutput (a dataclass) takes its fields by name
    except TypeError:
        return cls(items)


def describe_aux(aux, name: str = "aux") -> tuple[AuxOutputs, list[torch.Tensor]]:
    """aux's structure and constants, and its tensors in pytree order. `name`: what the messages call it (a
    forward-only function's whole output is described alike)."""
    _register_mappings(aux)
    paths, leaves, spec = optree.tree_flatten_with_path(aux, none_is_leaf=True, namespace=NAMESPACE)
    tensors = []
    for path, x in zip(paths, leaves):
        where = name + "".join(f"[{k!r}]" for k in path)
        if isinstance(x, torch.Tensor):
            tensors.append(x)
        elif isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            kind = {torch.SymInt: "an int", torch.SymFloat: "a float", torch.SymBool: "a bool"}[type(x)]
            raise UntraceableError(f"the step function returned {where}, {kind} read from a tensor's value "
                                   "(.item(), float(t), int(t), or a size that depends on values): a compiled step "
                                   "computes no Python number anew at each call; return the tensor itself (e.g. "
                                   "acc instead of acc.item()) and read it after the step")
        elif not isinstance(x, _CONSTANTS):
            cache = " (a model's cache of keys and values: call the model with use_cache=False)"
            raise UntraceableError(f"the step function returned {where} of type {type(x).__name__}; its leaves "
                                   "must be tensors or plain constants (int, float, bool, str, None)"
                                   + (cache if "Cache" in type(x).__name__ else ""))
    try:           # rebuilt once now, while tracing: a class that cannot be is refused before any update
        optree.tree_unflatten(spec, leaves)
    except Exception as e:  # noqa: BLE001 - any constructor's error
        raise UntraceableError(f"the step function returned {name} holding a mapping that cannot be rebuilt from its "
                               f"keys and values ({type(e).__name__}: {e}); return a dict instead") from e
    layout = AuxOutputs(spec, tuple(TENSOR_LEAF if isinstance(x, torch.Tensor) else x for x in leaves))
    return layout, tensors


class AuxCollector:
    """Collects aux over a traced step's micro-batches (see the module docstring): `add` after each micro-batch's
    forward, before its backward; `outputs` are then the graph's aux outputs and `layout` their structure."""

    def __init__(self, micro: int):
        self.micro = micro
        self.layout: AuxOutputs | None = None
        self.outputs: list[torch.Tensor] = []
        self._returned: bool | None = None

    def add(self, k: int, aux, returned: bool) -> None:
        if self._returned is not None and returned != self._returned:
            raise UntraceableError("the step function returned aux in some micro-batches only; " + _HOW)
        self._returned = returned
        if not returned:
            return
        layout, tensors = describe_aux(aux)
        if k == 0:
            self.layout = layout
        elif layout != self.layout:
            raise UntraceableError(
                f"with accumulate={self.micro} the step function returned aux of another structure or other "
                f"constants in micro-batch {k} than in micro-batch 0; aux is stacked over the micro-batches, so "
                "return the same structure (and constants) every time")
        if self.micro == 1:
            self.outputs = tensors
            return
        with torch.no_grad():         # a copy of the value, out of autograd's sight
            if k == 0:
                for i, t in enumerate(tensors):
                    if any(not isinstance(s, int) for s in t.shape):
                        raise UntraceableError(
                            f"with accumulate={self.micro} aux tensor {i} has a size that depends on tensor values "
                            f"({tuple(t.shape)}); aux is stacked over the micro-batches, so return fixed-size "
                            "tensors (pad or reduce it)")
                self.outputs = [t.new_zeros((self.micro, *t.shape)) for t in tensors]
            for stack, t in zip(self.outputs, tensors):
                stack.select(0, k).copy_(t)


def own_aux_storage(gm: fx.GraphModule, positions: range, roles: dict[fx.Node, Role]) -> None:
    """Give each aux output (at `positions` of the output list) that shares storage with a parameter, a buffer, the
    fp16 loss scale or a tensor constant a copy of its own, made right after it (in place on the freshly traced
    graph; see the module docstring). `roles`: the role of each placeholder."""
    graph = gm.graph
    shared = {storage_key(n.meta["val"]) for n in graph.nodes
              if isinstance(n.meta.get("val"), torch.Tensor)
              and (n.op == "get_attr" or (n.op == "placeholder" and roles[n] is not Role.INPUT))}
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    values = list(out.args[0])
    last_write: dict[int, fx.Node] = {}      # storage -> the last node writing into it (a buffer's update)
    for n in graph.nodes:
        for m in mutated_args(n):
            if isinstance(m.meta.get("val"), torch.Tensor):
                last_write[storage_key(m.meta["val"])] = n
    pos = {n: i for i, n in enumerate(graph.nodes)}
    copies: dict[fx.Node, fx.Node] = {}
    for i in positions:
        n = values[i]
        val = n.meta.get("val")
        key = storage_key(val)
        if key not in shared:
            continue
        if n not in copies:
            after = max([n] + ([last_write[key]] if key in last_write else []), key=pos.__getitem__)
            if after.op == "placeholder":     # right before the first op (a parameter is never written)
                where = graph.inserting_before(next(x for x in graph.nodes if x.op != "placeholder"))
            else:
                where = graph.inserting_after(after)
            with where:
                c = graph.call_function(torch.ops.aten.clone.default, (n,))
            with val.fake_mode:
                c.meta["val"] = torch.ops.aten.clone.default(val)
            copies[n] = c
        values[i] = copies[n]
    if copies:
        out.args = (values,)
        graph.lint()
