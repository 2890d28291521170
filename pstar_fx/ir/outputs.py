"""What a training graph returns: the loss, the user's auxiliary outputs, the gradients, in one flat list.

A step function returns the loss, or `(loss, aux)` with `aux` any pytree (tuples, lists, dicts) of tensors and
plain constants (ints, floats, bools, strings, None). The traced graph's outputs are, in this order:

    [loss, loss_1 .. loss_K (accumulate=K > 1 only), aux_0 .. aux_{n-1}, grad_0, ...]

where the aux tensors are the tensor leaves of `aux` in pytree order (with accumulate=K, each leaf stacked over the
K micro-batches on a new dimension 0). canonicalize drops the micro-batch losses (the mean reads them), and from
assign_chunks on the gradients have become writes into chunks: the graph returns `[loss, aux_0 .. aux_{n-1}]`.
`AuxOutputs` keeps what rebuilds `aux` from those tensors (a forward-only graph's whole output is described by one
too); every pass that reads the output list splits it with `split_outputs` and none counts positions of its own.
"""
from __future__ import annotations

from dataclasses import dataclass

import optree


class _TensorLeaf:
    def __repr__(self) -> str:
        return "<tensor>"


TENSOR_LEAF = _TensorLeaf()      # marks where a tensor goes among an AuxOutputs' leaves


@dataclass(frozen=True)
class AuxOutputs:
    """The structure of what a step function returned beside the loss."""
    spec: object                     # optree's PyTreeSpec of aux (none_is_leaf=True)
    leaves: tuple                    # every leaf: TENSOR_LEAF where a graph output goes, else the constant itself

    @property
    def count(self) -> int:
        """How many graph outputs (tensors) aux has."""
        return sum(x is TENSOR_LEAF for x in self.leaves)

    def rebuild(self, tensors) -> object:
        """aux with its tensor leaves taken from `tensors`, in order, and its constants as they were returned."""
        it = iter(tensors)
        out = optree.tree_unflatten(self.spec, [next(it) if x is TENSOR_LEAF else x for x in self.leaves])
        assert next(it, None) is None, "more aux tensors than the structure holds"
        return out


@dataclass(frozen=True)
class SplitOutputs:
    loss: object
    micro_losses: list               # one per micro-batch ([loss] itself without accumulation)
    aux: list                        # the aux tensors' outputs
    grads: list                      # empty from assign_chunks on


def split_outputs(outputs, micro: int, aux: AuxOutputs | None) -> SplitOutputs:
    """The output list of a training graph (see the module docstring) in its parts. `micro`: the number of
    micro-batch losses the list holds after the loss counted as K > 1 (the traced graph's accumulate), 1 for none."""
    outputs = list(outputs)
    n_aux = 0 if aux is None else aux.count
    first = 1 + (micro if micro > 1 else 0)
    micro_losses = outputs[1:first] if micro > 1 else outputs[:1]
    return SplitOutputs(outputs[0], micro_losses, outputs[first:first + n_aux], outputs[first + n_aux:])
