"""loss_rows: the cross-entropy of a large vocabulary computed in blocks of rows, so that its fp32 tensors are never
whole.

eager's `F.cross_entropy(logits.float(), targets)` makes, per micro-batch, an fp32 copy of the logits, their
log-softmax (kept for backward), and in backward the loss's gradient and the log-softmax's: three fp32 tensors of
tokens x vocabulary alive at once (about 9.4 GiB for 16,384 tokens of a 50,304 vocabulary) beside the half-precision
logits. Here the forward computes each block of rows' log-softmax and keeps only each row's value at its target;
backward computes each block's log-softmax again from the logits and its gradient from it. What stays alive between
them is the logits (half the size of the fp32 log-softmax in mixed precision), and at most a block of each fp32
tensor at a time.

Invariant after (each rewritten loss, the pattern below, one per micro-batch): every value the graph returns or
writes has the same bits as before. Row-wise operators (the conversions between dtypes, `_log_softmax`,
`nll_loss_backward`, `_log_softmax_backward_data`) compute each row alone, so a block of rows is the same rows' bits;
the loss itself is `nll_loss_forward` over a tokens x 1 (or x 2) tensor of the rows' target values, whose reduction
adds the same values in the same order as over the whole log-softmax (it reads only the target's column, and its
order depends on the rows alone). Nothing else changes.

The pattern: `ls = _log_softmax(x, 1)` of a 2-D fp32 `x` whose only users are `nll_loss_forward(ls, t, None, r, i)`,
`nll_loss_backward(g, ls, t, None, r, i, w)` and `_log_softmax_backward_data(that, ls, 1, float32)`, the backward
one's only user; no class weights. `x` is either an fp32 conversion (`_to_copy`) of a contiguous half-precision
tensor, through views (mixed precision: the blocks convert blocks of it), or is read in blocks itself. A conversion
of the log-softmax's gradient back to half precision, its only user, is done per block too. Or (CUDA's autocast of
`F.cross_entropy` on bf16 logits: the log-softmax in the logits' dtype, the loss in fp32) `ls` of a half-precision
`x` read in blocks, the nll ops reading its fp32 conversion, and `_log_softmax_backward_data` reading their
gradient converted back to `ls`' dtype: each block converts its own log-softmax, and its gradient back.

Which losses are split: those whose fp32 tokens x vocabulary tensor is at least two blocks of the settings'
`loss_block_bytes` (`LOSS_BLOCK_BYTES`, 256 MiB, unless a test sets it). By the settings' `loss_rows`: ALWAYS, this
stage splits them; WHERE_NEEDED (the default), this stage splits none and the remat pass splits them where the step
would not fit the budget otherwise: where it fits, the whole tensors cost nothing but room, and the blocks would
cost the backward's second log-softmax (a few milliseconds at 16k x 50k on an H200) while the room they free would
go to more optimizer states on the device, which is not always faster (the cost model estimated the 17.26B GPT's
atomic step no faster so; 6% faster only where a 128k vocabulary meets an 80 GB device, docs/memory.md); NEVER,
none is split.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from ..ir.fx_utils import is_plain_cast, refresh_views, storage_key
from ..ir.graph import (LOSS_ROWS_SEGMENT, REMAT, LossRows, NodeAnn, Phase, RematTag, Role, TrainGraph,
                        copy_graph, to_module)

aten = torch.ops.aten

_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}


@dataclasses.dataclass(frozen=True)
class _Match:
    log_softmax: fx.Node
    nll: fx.Node              # nll_loss_forward
    nll_grad: fx.Node         # nll_loss_backward
    grad: fx.Node             # _log_softmax_backward_data
    to_half: fx.Node | None   # its conversion back to half precision, the only user
    source: fx.Node           # the tensor read in blocks: the half-precision one converted, or x itself
    convert: fx.Node | None   # the fp32 conversion of source (its kwargs are the blocks')
    rows: int
    cols: int
    up: fx.Node | None = None     # a half-precision log-softmax: its fp32 conversion, which the nll ops read
    down: fx.Node | None = None   # and their gradient's conversion back, which its backward reads


def may_split(g: TrainGraph) -> bool:
    """Whether the remat pass may split g's losses where the step would not fit otherwise."""
    return g.settings.loss_rows is LossRows.WHERE_NEEDED


def loss_rows(g: TrainGraph, force: bool = False) -> TrainGraph:
    """The stage: g with each large cross-entropy computed in blocks of rows where the settings say ALWAYS, or where
    `force` (the remat pass's last resort); g's graph otherwise (module docstring: the invariant, the pattern)."""
    block = g.settings.loss_block_bytes if force or g.settings.loss_rows is LossRows.ALWAYS else 0
    graph, _ = copy_graph(g)
    ann = dict(g.ann)
    split = 0
    if block > 0:
        for node in list(graph.nodes):
            m = _match(node)
            if m is None or m.rows * m.cols * 4 < 2 * block:
                continue
            _rewrite(graph, m, max(1, block // (4 * m.cols)), ann)
            split += 1
    if not split:
        return g.evolve(stage="loss_rows", made_by="loss_rows (nothing split)")
    graph.lint()
    names = {n.name for n in graph.nodes}
    ann = {k: v for k, v in ann.items() if k in names}
    return g.evolve(gm=to_module(graph, g.gm), stage="loss_rows", ann=ann,
                    made_by=f"loss_rows ({split} cross-entropy loss{'es' if split > 1 else ''} in blocks of rows)")


def _only_user(n: fx.Node) -> fx.Node | None:
    return next(iter(n.users)) if len(n.users) == 1 else None


def _match(ls: fx.Node) -> _Match | None:
    if ls.op != "call_function" or ls.target is not aten._log_softmax.default:
        return None
    x, dim, half_to_float = ls.args
    xv = x.meta.get("val")
    if half_to_float or not isinstance(xv, torch.Tensor) or xv.dim() != 2 or dim not in (1, -1):
        return None
    if xv.dtype is torch.float32:          # the nll ops read the log-softmax itself
        up, values, below = None, ls, 3
    elif xv.dtype in (torch.bfloat16, torch.float16):    # they read its fp32 conversion
        up = next((u for u in ls.users if is_plain_cast(u) and u.kwargs.get("dtype") == torch.float32), None)
        if up is None or len(up.users) != 2:
            return None
        values, below = up, 2
    else:
        return None
    users = {u.target: u for u in values.users}
    if len(users) != 2 + (up is None) or len(ls.users) != below:
        return None
    nll, nll_grad = users.get(aten.nll_loss_forward.default), users.get(aten.nll_loss_backward.default)
    grad = next((u for u in ls.users if u.target is aten._log_softmax_backward_data.default), None)
    if nll is None or nll_grad is None or grad is None:
        return None
    if nll.args[0] is not values or nll.args[2] is not None or len(nll.args) != 5 or nll.kwargs:
        return None
    if nll_grad.args[1] is not values or nll_grad.args[2] is not nll.args[1] or nll_grad.args[3] is not None \
            or tuple(nll_grad.args[4:6]) != tuple(nll.args[3:5]) or nll_grad.kwargs:
        return None
    down = None
    if up is not None:                     # the gradient converted back to the log-softmax's dtype before its own
        down = _only_user(nll_grad)
        if down is None or not is_plain_cast(down) or down.kwargs.get("dtype") != xv.dtype:
            return None
    feed = down if down is not None else nll_grad
    if grad.args[0] is not feed or grad.args[1] is not ls or grad.args[2] not in (1, -1) \
            or _only_user(feed) is not grad:
        return None
    to_half = _only_user(grad)
    if to_half is not None and not is_plain_cast(to_half):
        to_half = None
    source, convert = _source(x) if up is None else (x, None)
    rows, cols = xv.shape
    return _Match(ls, nll, nll_grad, grad, to_half, source, convert, int(rows), int(cols), up, down)


def _source(x: fx.Node) -> tuple[fx.Node, fx.Node | None]:
    """What blocks of x's rows are made from: the half-precision tensor x converts (through views of the
    conversion, each used only on the way to x; the tensor contiguous, so a view of it has x's rows), or x."""
    n = x
    while n.op == "call_function" and n.target in _VIEWS and len(n.users) == 1:
        n = n.args[0]
    if is_plain_cast(n) and (n is x or len(n.users) == 1):
        src = n.args[0]
        v = src.meta.get("val")
        if isinstance(v, torch.Tensor) and v.is_contiguous() and v.dtype in (torch.bfloat16, torch.float16):
            return src, n
    return x, None


def _rewrite(graph: fx.Graph, m: _Match, block_rows: int, ann: dict) -> None:
    target, reduction, ignore = m.nll.args[1], m.nll.args[3], m.nll.args[4]
    fake = m.log_softmax.meta["val"].fake_mode
    col = 1 if ignore == 0 else 0        # the column of the rows' values: not the ignored index

    def add(target_fn, args, kwargs=None, phase=Phase.FORWARD) -> fx.Node:
        n = graph.call_function(target_fn, tuple(args), kwargs or {})
        vals = fx.node.map_arg((n.args, n.kwargs), lambda a: a.meta["val"])
        with fake:
            n.meta["val"] = target_fn(*vals[0], **vals[1])
        if "stack_trace" in m.log_softmax.meta:
            n.meta["stack_trace"] = m.log_softmax.meta["stack_trace"]
        ann[n.name] = NodeAnn(role=Role.COMPUTE, phase=phase)
        return n

    made: list[fx.Node] = []            # forward's block nodes, in order: backward's are tagged as their recomputes

    def blocks(again: bool):
        """Per block: (start, end, its log-softmax, what the nll ops read: that or its fp32 conversion); the source
        viewed as rows x vocabulary first. again: in backward, each node tagged as the recompute of its forward twin
        (printed so, as remat's copies are)."""
        twins = iter(list(made))

        def node(fn, args, kwargs=None):
            n = add(fn, args, kwargs)
            if again:
                n.meta[REMAT] = RematTag(segment=LOSS_ROWS_SEGMENT, recompute_of=next(twins).name)
            else:
                made.append(n)
            return n
        src = m.source
        if tuple(src.meta["val"].shape) != (m.rows, m.cols):
            src = node(aten.view.default, (src, [m.rows, m.cols]))
        for a in range(0, m.rows, block_rows):
            b = min(a + block_rows, m.rows)
            x = node(aten.slice.Tensor, (src, 0, a, b))
            if m.convert is not None:
                x = node(aten._to_copy.default, (x,), dict(m.convert.kwargs))
            ls = node(aten._log_softmax.default, (x, 1, False))
            yield a, b, ls, ls if m.up is None else node(aten._to_copy.default, (ls,), dict(m.up.kwargs))

    # forward: each row's value at its target, then the loss over those (where the loss was: the target may be
    # computed after the log-softmax)
    with graph.inserting_before(m.nll):
        safe = add(aten.where.ScalarOther, (add(aten.ne.Scalar, (target, ignore)), target, 0))
        picked = []
        for a, b, _, vals in blocks(again=False):
            t = add(aten.unsqueeze.default, (add(aten.slice.Tensor, (safe, 0, a, b)), 1))
            picked.append(add(aten.gather.default, (vals, 1, t)))
        values = add(aten.cat.default, (picked,)) if len(picked) > 1 else picked[0]
        if col:
            values = add(aten.cat.default, ([values, values], 1))
        mapped = add(aten.where.ScalarOther, (add(aten.eq.Scalar, (target, ignore)), target, col))
        nll = graph.call_function(aten.nll_loss_forward.default, (values, mapped, None, reduction, ignore))
        nll.meta.update(m.nll.meta)
        ann[nll.name] = ann[m.nll.name]
    m.nll.replace_all_uses_with(nll)

    # backward: each block's log-softmax again, its gradient, converted back where the graph did
    grad_out, weight_total = m.nll_grad.args[0], m.nll_grad.args[6]
    per_row = reduction == 0             # 'none': the incoming gradient has a row each
    with graph.inserting_before(m.nll_grad):
        pieces = []
        for a, b, ls, vals in blocks(again=True):
            t = add(aten.slice.Tensor, (target, 0, a, b))
            g = add(aten.slice.Tensor, (grad_out, 0, a, b), phase=Phase.BACKWARD) if per_row else grad_out
            gn = add(aten.nll_loss_backward.default, (g, vals, t, None, reduction, ignore, weight_total),
                     phase=Phase.BACKWARD)
            if m.down is not None:
                gn = add(aten._to_copy.default, (gn,), dict(m.down.kwargs), phase=Phase.BACKWARD)
            gi = add(aten._log_softmax_backward_data.default, (gn, ls, 1, m.grad.args[3]), phase=Phase.BACKWARD)
            if m.to_half is not None:
                gi = add(aten._to_copy.default, (gi,), dict(m.to_half.kwargs), phase=Phase.BACKWARD)
            pieces.append(gi)
        whole = add(aten.cat.default, (pieces,), phase=Phase.BACKWARD) if len(pieces) > 1 else pieces[0]
    last = m.to_half if m.to_half is not None else m.grad
    last.replace_all_uses_with(whole)
    refresh_views(whole, storage_key(last.meta["val"]))
    x = m.log_softmax.args[0]
    for n in (m.to_half, m.grad, m.down, m.nll_grad, m.nll, m.up, m.log_softmax):
        if n is not None:
            graph.erase_node(n)
    # the whole fp32 tensor the blocks replace, and the views on the way to it, where nothing else reads them
    while x is not m.source and not x.users and (x.target in _VIEWS or x is m.convert):
        x, dead = x.args[0], x
        graph.erase_node(dead)
