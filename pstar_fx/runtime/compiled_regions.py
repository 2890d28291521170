"""Compiling fused regions (passes/regions.py) into code, and keeping what was compiled.

A region's graph is functional aten with static shapes (the fuse pass admits nothing else). It is decomposed with
Inductor's own decomposition table (make_fx, over fake inputs of the region's shapes, strides and offsets) and
compiled by `torch._inductor.compile_fx.compile_fx_inner`, the entry Inductor itself uses once AOTAutograd has
prepared a graph. Why that entry and not torch.compile or torch._inductor.compile: the graph is already an aten
graph with nothing to guard, so Dynamo has nothing to do, and AOTAutograd's runtime wrappers cost a region about as
much time per call as the tiny ops they replace (on the CPU machine: 205 us against 35 us per call for a
matmul-bias-gelu region); compile_fx_inner has the same signature on torch 2.11 through 2.14.

Caching: a region's graph is built with canonical names (passes/regions.py), so identical regions (the layers of a
model) have identical code and are compiled once per `RegionCompiler`, keyed by the code and the inputs' metadata.
Across processes Inductor's FX graph cache (on by default, under torch's cache directory or TORCHINDUCTOR_CACHE_DIR)
holds the compiled code: it keys on the graph and its inputs, and needs the fake inputs to carry a ShapeEnv, which
they do here. A second process compiling the same model finds every region there (`RegionStats.cache_hits`).

Layouts: a region is compiled for its inputs' traced shapes, strides and offsets, and Inductor's code checks the
shapes and strides at every call. Its outputs keep their traced strides: Inductor is told every output is visible,
as torch.compile tells it of a graph's user outputs (left free, it may hand back an output as a view into a buffer
it shares with another, as it can a `cat`'s inputs, and a later region compiled for the traced layout refuses it: on
the H200 a fused Llama step failed so, half a rotary embedding's head dimension arriving as a view into the whole).
Where an input still arrives with other strides (an eager kernel whose real strides differ from its traced ones),
the region is compiled again for them at its first such call and both are kept (`RegionStats.relaid`): the values
are the same whatever the layout.

Repeatable: by default Inductor picks among a reduction kernel's configurations (its block sizes, hence the order of
its sums) by timing them at the first call, so two compiles of one region (a run and its resumption from a
checkpoint, a test's two steps) could differ in the last bits. Regions compile in Inductor's deterministic mode
(`torch._inductor.config.deterministic`, which keeps one configuration per reduction, chosen without timing it), where
the torch in use has it.

A region Inductor fails to compile runs eagerly (ops.region, the nodes as traced) and is counted: the plan holds
either way, since a region's inputs and outputs are the same values.

The launcher: Inductor launches a region's Triton kernels through its own static launcher by default, which holds
the GIL while it launches; Triton's launcher lets it go. On a GPU the executor runs ahead of the device until CUDA's
launch queue is full (about a thousand kernels), and then waits inside a launch: inside the static launcher it waits
holding the GIL, and the CPU worker's host-side updates, which take the GIL back between their operators, wait with
it. On an H100 (a 10.34B GPT whose step the CPU worker bounds) the worker spent 702 of 1,363 ms between its
operators with the static launcher, 39 ms with Triton's, and the step ran 5.4% faster
(benchmarks/results/fused_cpu_updates_h100_2026-12-05.md). Regions compile with Triton's launcher
(`use_static_cuda_launcher` off over the compile). Beside a fused step the worker's updates are still about 1.3x
slower than beside an unfused one, inside their operators, for a cause not established; the cost model charges it
(`cost.Machine.cpu_adam_beside_fused`).

Compile workers: on a GPU Inductor compiles Triton kernels in a pool of worker processes (one per core, each a
forked torch process), which Dynamo winds down after its own compiles; after `compile_fx_inner`'s, in the torch of
the H200 machine (2.11), nothing does, and the 16 workers would stay for the life of the process beside the step,
on a host whose memory the plan fills (about 112 of 125 GiB at the 17.26B GPT). Once a graph's regions (or a
region's new layout) are compiled, the pool is shut down (`torch._inductor.async_compile.shutdown_compile_workers`);
a later compile, pstar-fx's or the user's torch.compile, starts it again. (They were not what slowed the CPU worker:
none ran during the fused steps that were slowed.)
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import warn
from ..ir.fx_utils import output_node
from ..ir.ops import RegionSpec


@dataclass
class RegionStats:
    """What compiling a graph's regions took."""
    regions: int = 0                 # region nodes of the graph
    nodes: int = 0                   # compute nodes they replace
    compiled: int = 0                # distinct region graphs compiled (identical regions share one)
    cache_hits: int = 0              # of those, found in Inductor's FX graph cache (compiled earlier: by an earlier
    #                                  process, or in this one for a region of other code but the same Inductor graph)
    eager: int = 0                   # regions that could not be compiled and run eagerly
    seconds: float = 0.0
    relaid: int = 0                  # compiled again at a call whose inputs came in another layout than traced

    def __str__(self) -> str:
        return (f"{self.regions} regions of {self.nodes} nodes, {self.compiled} compiled "
                f"({self.cache_hits} from the cache{f', {self.eager} eager' if self.eager else ''}"
                f"{f', {self.relaid} again for another input layout at run time' if self.relaid else ''}) "
                f"in {self.seconds:.1f} s")


def _input_key(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype, t.device.type)


class RegionCompiler:
    """Compiles regions, keeping each compiled callable by its region's code and input metadata."""

    def __init__(self):
        self._cache: dict[tuple, Callable[[list], list]] = {}

    def compile_all(self, specs: list[RegionSpec], between: Callable[[], None] | None = None
                    ) -> tuple[list[Callable[[list], list]], RegionStats]:
        """A callable per region, each taking the list of the region's inputs and returning its outputs. `between()`
        runs after each (a Ctrl-C held over the compile is taken there: what compiled stays in this compiler)."""
        stats = RegionStats(regions=len(specs), nodes=sum(s.nodes for s in specs))
        t0 = time.perf_counter()
        out = []
        for s in specs:
            out.append(self._one(s, stats))
            if between is not None:
                between()
        release_compile_workers()
        stats.seconds = time.perf_counter() - t0
        return out, stats

    def _one(self, spec: RegionSpec, stats: RegionStats) -> Callable[[list], list]:
        vals = [n.meta["val"] for n in spec.gm.graph.nodes if n.op == "placeholder"]
        layout = tuple(_input_key(v) for v in vals)

        def compile_for(args: list, key: tuple) -> Callable[[list], list]:
            """The region compiled for these inputs of layout `key` (a call's that the traced layout did not fit)."""
            stats.relaid += (spec.gm.code, key) not in self._cache
            fn = self._variant(spec, args, key, stats)
            release_compile_workers()
            return fn

        return _Guarded(self._variant(spec, vals, layout, stats), layout, compile_for)

    def _variant(self, spec: RegionSpec, vals: list, layout: tuple, stats: RegionStats) -> Callable[[list], list]:
        """The region compiled for inputs of this layout (vals: tensors, real or fake, of it)."""
        key = (spec.gm.code, layout)
        fn = self._cache.get(key)
        if fn is not None:
            return fn
        hits = _cache_hits()
        try:
            fn = _compile(spec.gm, vals)
        except Exception as e:  # noqa: BLE001 - any Inductor failure: the region runs eagerly
            warn(f"pstar-fx: fuse=True could not compile {spec!r} ({type(e).__name__}: {str(e)[:200]}); "
                 "it runs eagerly")
            stats.eager += 1
            gm = spec.gm
            fn = lambda args: gm(*args)  # noqa: E731
        else:
            stats.compiled += 1
            stats.cache_hits += _cache_hits() - hits
        self._cache[key] = fn
        return fn


class _Guarded:
    """A compiled region that checks its inputs' shapes and strides (what Inductor's code asserts; an offset into
    the storage it takes as it comes) against those of each variant compiled so far, the traced layout's first, and
    calls the first that fits; a call that none fits gets a variant of its own from `compile_for`, kept."""
    __slots__ = ("variants", "compile_for")

    def __init__(self, fn: Callable[[list], list], layout: tuple, compile_for: Callable[[list, tuple], Callable]):
        self.variants = [(_shapes_strides(layout), fn)]
        self.compile_for = compile_for

    def __call__(self, args: list) -> list:
        for want, fn in self.variants:
            if all(a.stride() == stride and a.shape == shape for a, (shape, stride) in zip(args, want)):
                return fn(args)
        layout = tuple(_input_key(a) for a in args)
        fn = self.compile_for(args, layout)
        self.variants.append((_shapes_strides(layout), fn))
        return fn(args)


def release_compile_workers() -> None:
    """Shut Inductor's compile worker processes down (the module docstring says why), where this torch has the call."""
    from torch._inductor import async_compile
    shutdown = getattr(async_compile, "shutdown_compile_workers", None)
    if shutdown is not None:
        shutdown()


def _shapes_strides(layout: tuple) -> tuple:
    return tuple(k[:2] for k in layout)


def _cache_hits() -> int:
    from torch._dynamo.utils import counters
    return counters["inductor"]["fxgraph_cache_hit"]


def _compile(gm: torch.fx.GraphModule, vals: list[torch.Tensor]) -> Callable[[list], list]:
    from torch._guards import TracingContext, tracing
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv())
    with mode:
        fakes = [torch.empty(v.untyped_storage().nbytes() // v.element_size(), dtype=v.dtype, device=v.device)
                 .as_strided(v.shape, v.stride(), v.storage_offset()) for v in vals]
        decomposed = make_fx(gm, decomposition_table=select_decomp_table())(*fakes)
    _keep_output_strides(decomposed, gm)
    with tracing(TracingContext(mode)), _compile_config():
        compiled = compile_fx_inner(decomposed, fakes)
    if getattr(compiled, "_boxed_call", False):
        return compiled
    return lambda args: compiled(*args)


def _compile_config():
    """Inductor's settings over a region's compile (the module docstring says why), each where this torch has it:
    its deterministic mode (the kernels carry it: their reductions keep one configuration), and Triton's own kernel
    launcher rather than Inductor's static one (the compiled module keeps the launcher it was built with)."""
    import torch._inductor.config as inductor_config
    settings = {name: value for name, value in (("deterministic", True), ("use_static_cuda_launcher", False))
                if hasattr(inductor_config, name)}
    return inductor_config.patch(settings)


def _keep_output_strides(compiled: torch.fx.GraphModule, traced: torch.fx.GraphModule) -> None:
    """Tell Inductor that every output of `compiled` (the decomposed region) is visible, with the strides the region
    had as traced (`traced`'s output values): the meta Inductor's own compile_fx sets for a graph's user outputs,
    which its GraphLowering reads under compile_fx_inner (torch 2.13's source; torch 2.11 on the H200 ran the fused
    Llama-2-13B step with it)."""
    out = output_node(compiled.graph)
    args = _returned(out)
    strides = []
    for n in _returned(output_node(traced.graph)):
        val = n.meta.get("val") if isinstance(n, torch.fx.Node) else None
        strides.append(tuple(val.stride()) if isinstance(val, torch.Tensor) else None)
    if len(strides) != len(args):
        return
    out.meta["original_output_strides"] = strides
    out.meta["user_visible_output_idxs"] = [i for i, (n, st) in enumerate(zip(args, strides))
                                            if isinstance(n, torch.fx.Node) and st is not None]


def _returned(out: torch.fx.Node) -> tuple:
    """What an output node returns, as a sequence (a single value made a tuple of one)."""
    return out.args[0] if not isinstance(out.args[0], torch.fx.Node) else out.args
