"""benchmarks/trace_steps.py reads a profiler trace step by step: here a synthetic one, to check what it attributes to
the caching allocator's retries (an operator that synchronised the device) and what it does not."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _trace_steps():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import trace_steps
    return trace_steps


def _x(name, cat, ts, dur, tid=1, **args):
    return dict(ph="X", name=name, cat=cat, ts=ts, dur=dur, pid=1, tid=tid, args=args)


def test_idle_compute_inside_a_synchronising_operator_is_the_allocators():
    ts = _trace_steps()
    ms = 1000.0                                   # trace times are microseconds
    events = [
        _x("pstar-fx step 0", "user_annotation", 0, 1000 * ms),
        _x("ampere_gemm", "kernel", 0, 100 * ms, tid=7, stream=7),
        _x("ampere_gemm", "kernel", 300 * ms, 700 * ms, tid=7, stream=7),        # idle 100-300 ms
        _x("aten::mul", "cpu_op", 90 * ms, 200 * ms),                            # a retry: 100-290 ms idle
        _x("aten::empty_strided", "cpu_op", 92 * ms, 190 * ms),                  # nested in it
        _x("cudaStreamSynchronize", "cuda_runtime", 95 * ms, 5 * ms),
        _x("aten::item", "cpu_op", 500 * ms, 10 * ms),                          # a read: not the allocator
        _x("cudaStreamSynchronize", "cuda_runtime", 501 * ms, 8 * ms),
        _x("cudaDeviceSynchronize", "cuda_runtime", 990 * ms, 10 * ms),          # the step's own, in no operator
        _x("aten::add", "cpu_op", 295 * ms, 1 * ms),                              # no synchronisation inside
    ]
    (step,) = ts.read(events, gaps=2)
    assert step["compute_idle_ms"] == 200.0
    assert step["allocator_idle_ms"] == 190.0
    assert step["allocator_ops"] == 1
    assert step["gaps"][0]["ms"] == 200.0 and step["gaps"][0]["main"][0][0] == "aten::mul"


def test_time_between_the_workers_operators_inside_its_updates():
    ts = _trace_steps()
    ms = 1000.0
    run = _x("pstar-fx host update of chunk 3", "user_annotation", 100 * ms, 50 * ms, tid=2)
    events = [
        _x("aten::to", "cpu_op", 100 * ms, 10 * ms, tid=2),
        _x("aten::copy_", "cpu_op", 101 * ms, 8 * ms, tid=2),                    # nested: counted once
        _x("aten::_fused_adamw_", "cpu_op", 115 * ms, 20 * ms, tid=2),            # 5 ms between
        _x("aten::copy_", "cpu_op", 135 * ms, 5 * ms, tid=2),
        _x("aten::add", "cpu_op", 120 * ms, 30 * ms, tid=1),                      # another thread's
        _x("aten::copy_", "cpu_op", 160 * ms, 5 * ms, tid=2),                     # after the update
    ]
    got = ts.between_ops([run], events)
    assert got == dict(in_ops_ms=35.0, between_ops_ms=15.0, ops=3, longest_between_ms=10.0)


def test_all_prints_the_steps_then_their_update_chains(tmp_path, capsys):
    ts = _trace_steps()
    ms = 1000.0
    events = [
        _x("pstar-fx step 0", "user_annotation", 0, 1000 * ms),
        _x("ampere_gemm", "kernel", 0, 600 * ms, tid=7, stream=7),
        _x("pstar-fx commit", "user_annotation", 600 * ms, 1 * ms),
        _x("pstar-fx queue the host update of chunk 3", "user_annotation", 601 * ms, 1 * ms),
        _x("pstar-fx host update of chunk 3", "user_annotation", 610 * ms, 50 * ms, tid=2),
    ]
    path = tmp_path / "trace.json"
    path.write_text(__import__("json").dumps(dict(traceEvents=events)))
    outputs = {}
    for flags in ([], ["--updates"], ["--all"]):
        ts.main([str(path)] + flags)
        outputs[tuple(flags)] = capsys.readouterr().out.splitlines()
    steps, chains, both = outputs[()], outputs[("--updates",)], outputs[("--all",)]
    assert steps and chains and steps != chains
    assert '"compute_idle_ms"' in steps[0] and '"queued"' in chains[0]
    assert both == steps + chains
