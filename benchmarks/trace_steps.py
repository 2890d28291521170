"""Where each step of a profiled run goes: a reading of the torch.profiler trace that `benchmarks/gpt.py --profile DIR
--profile-steps N` writes (DIR/pstar_<budget>.json.gz), step by step.

    python benchmarks/trace_steps.py DIR/pstar_137GiB.json.gz [--gaps 8]

Per step (a step runs from one 'pstar-fx step i' marker's start on the executor's thread to the next's; the last to
the end of the trace), in milliseconds from the step's start:
  compute   the compute stream's busy time (the stream with the most kernel time), and its idle time in the step
  copies    H2D and D2H busy time (streams whose time is mostly those copies)
  worker    the CPU worker's updating time (its 'pstar-fx host update of chunk c' markers; in traces without them,
            fused Adam CPU kernels on the thread that runs most of them), its first start and last end
  allocator the compute stream's idle time while the executor's thread was inside an operator that synchronised
            the device (a cudaStreamSynchronize / cudaDeviceSynchronize / cudaEventSynchronize within an aten
            operator other than item / nonzero / local_scalar_dense: the caching allocator's retry, which frees its
            cache and maps memory again while the launch queue stays empty), and how many such operators
  gaps      the longest stretches with the compute stream idle, each with what the executor's thread did meanwhile
            (the runtime calls and operators that covered most of the gap) and whether the worker was updating
With --updates (instead; with --all, after the steps), per step, the chain of host-side updates the step queued (its
markers 'pstar-fx commit', 'pstar-fx queue the host update of chunk c', 'pstar-fx wait for the copies of chunk c'),
in ms from the step's start:
  commit_host / commit_gpu   the executor's thread at the commit, and the GPU reaching it (its first kernel)
  queued                     the first and last update queued
  first_update / last_end    the chain's first update's start and its last one's end (past the step's wall: the
                             next step's forward ran beside it)
  updating / waiting / idle  the worker's time in the chain: updating, waiting for gradient copies, and neither
                             (the next update not queued yet)
  held_after_commit          the executor thread's longest CUDA calls of 5 ms or more after the commit (at, call,
                             ms), and their sum
  in_ops / between_ops       inside the updates, the worker thread's time in its operators (outermost aten calls)
                             and between them: Python, and waits for the GIL the operators released (a thread that
                             asks for the GIL back while another runs Python waits up to the interpreter's switch
                             interval, 5 ms); ops, and the longest stretch between two of them
"""
from __future__ import annotations

import argparse
import bisect
import gzip
import json
from collections import defaultdict


def union(iv):
    """Sorted disjoint intervals covering the (start, end) intervals iv."""
    out: list[list[float]] = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def length(iv) -> float:
    return sum(b - a for a, b in iv)


def intersect(x, y) -> list[tuple[float, float]]:
    """The overlap of two sorted disjoint interval lists."""
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if a < b:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def _clip(iv, lo, hi):
    return [(max(a, lo), min(b, hi)) for a, b in iv if b > lo and a < hi]


def _gaps(busy, lo, hi):
    """The stretches of [lo, hi) not covered by the (sorted, disjoint) intervals busy."""
    out, t = [], lo
    for a, b in _clip(busy, lo, hi):
        if a > t:
            out.append((t, a))
        t = max(t, b)
    if t < hi:
        out.append((t, hi))
    return out


def stream_lanes(events: list[dict]) -> tuple[dict[str, list], int]:
    """The GPU's busy intervals per lane, each stream labelled by what takes most of its time (kernels: compute,
    HtoD copies: H2D, DtoH copies: D2H) and its intervals merged into its lane's; and the number of streams."""
    streams: dict = defaultdict(lambda: dict(iv=[], compute=0.0, H2D=0.0, D2H=0.0))
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            s = streams[e["args"].get("stream", -1)]
            s["iv"].append((e["ts"], e["ts"] + e["dur"]))
            s["H2D" if "HtoD" in e["name"] else "D2H" if "DtoH" in e["name"] else "compute"] += e["dur"]
    lanes: dict[str, list] = defaultdict(list)
    for s in streams.values():
        lanes[max(("compute", "H2D", "D2H"), key=s.get)].extend(s["iv"])
    return {k: union(v) for k, v in lanes.items()}, len(streams)


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
READS = ("aten::item", "aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero")   # synchronise by design


def synchronising_ops(on_main: list[dict]) -> list[tuple[float, float]]:
    """The (start, end) of the executor thread's aten operators that called a device synchronisation inside (its
    own reads of a value excepted): the caching allocator's retries."""
    syncs = sorted(e["ts"] for e in on_main if e.get("cat") == "cuda_runtime" and e["name"] in SYNCS)
    ops = [e for e in on_main if e.get("cat") == "cpu_op" and str(e["name"]).startswith("aten::")
           and e["name"] not in READS]
    out = []
    for e in ops:
        lo, hi = e["ts"], e["ts"] + e["dur"]
        k = bisect.bisect_left(syncs, lo)
        if k < len(syncs) and syncs[k] <= hi:
            out.append((lo, hi))
    return out


def read(events: list[dict], gaps: int = 8) -> list[dict]:
    """Per step, the figures the module docstring lists (times in ms from the step's start)."""
    xs = [e for e in events if e.get("ph") == "X" and "dur" in e]
    marks = sorted((e for e in xs if str(e.get("name", "")).startswith("pstar-fx step ")
                    and e.get("cat") == "user_annotation"), key=lambda e: e["ts"])
    if not marks:
        raise SystemExit("no 'pstar-fx step i' markers in the trace: profile with benchmarks/gpt.py --profile")
    main = (marks[0]["pid"], marks[0]["tid"])
    lanes, _ = stream_lanes(xs)
    adam_by_thread: dict = defaultdict(list)
    marked = [e for e in xs if str(e.get("name", "")).startswith("pstar-fx host update of chunk ")]
    for e in marked or [e for e in xs if e.get("cat") == "cpu_op" and "fused_adam" in e["name"] and e["dur"] > 200]:
        adam_by_thread[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    worker = union(max(adam_by_thread.values(), key=length)) if adam_by_thread else []
    on_main = [e for e in xs if (e["pid"], e["tid"]) == main and e.get("cat") in ("cuda_runtime", "cpu_op")
               and not str(e["name"]).startswith("pstar-fx step ")]
    end = max(e["ts"] + e["dur"] for e in xs)
    retries = synchronising_ops(on_main)
    out = []
    for i, m in enumerate(marks):
        lo = m["ts"]
        hi = marks[i + 1]["ts"] if i + 1 < len(marks) else end
        compute = _clip(lanes.get("compute", []), lo, hi)
        idle = _gaps(lanes.get("compute", []), lo, hi)
        w = _clip(worker, lo, hi)
        held = [iv for iv in retries if lo <= iv[0] < hi]
        rows = []
        for a, b in sorted(idle, key=lambda ab: ab[0] - ab[1])[:gaps]:
            cover: dict[str, float] = defaultdict(float)
            for e in on_main:
                x, y = max(a, e["ts"]), min(b, e["ts"] + e["dur"])
                if x < y:
                    cover[e["name"]] += y - x
            top = sorted(cover.items(), key=lambda kv: -kv[1])[:3]
            rows.append(dict(at_ms=round((a - lo) / 1e3, 1), ms=round((b - a) / 1e3, 1),
                             worker_updating_ms=round(length(_clip(worker, a, b)) / 1e3, 1),
                             main=[(k[:60], round(v / 1e3, 1)) for k, v in top]))
        out.append(dict(step=i, wall_ms=round((hi - lo) / 1e3, 1), host_call_ms=round(m["dur"] / 1e3, 1),
                        compute_ms=round(length(compute) / 1e3, 1), compute_idle_ms=round(length(idle) / 1e3, 1),
                        h2d_ms=round(length(_clip(lanes.get("H2D", []), lo, hi)) / 1e3, 1),
                        d2h_ms=round(length(_clip(lanes.get("D2H", []), lo, hi)) / 1e3, 1),
                        worker_ms=round(length(w) / 1e3, 1),
                        worker_first_ms=round((w[0][0] - lo) / 1e3, 1) if w else None,
                        worker_last_ms=round((w[-1][1] - lo) / 1e3, 1) if w else None,
                        allocator_idle_ms=round(length(intersect(idle, union(held))) / 1e3, 1),
                        allocator_ops=len(union(held)),
                        gaps=rows))
    return out


def _kernel_starts(xs: list[dict]) -> dict:
    """Each launch's correlation id -> the GPU start of the kernel (or copy) it launched."""
    return {e["args"]["correlation"]: e["ts"] for e in xs
            if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "correlation" in e.get("args", {})}


def _chunk_of(name: str) -> int:
    return int(name.rsplit(" ", 1)[1])


def _outermost(ops: list[dict]) -> list[tuple[float, float]]:
    """The (start, end) of the operators not inside another one (events of one thread)."""
    out: list[tuple[float, float]] = []
    for e in sorted(ops, key=lambda e: (e["ts"], -e["dur"])):
        if out and e["ts"] + e["dur"] <= out[-1][1]:
            continue
        out.append((e["ts"], e["ts"] + e["dur"]))
    return out


def between_ops(runs: list[dict], xs: list[dict]) -> dict:
    """Inside the given update markers: the time in their thread's outermost aten operators and between them."""
    threads = {(r["pid"], r["tid"]) for r in runs}
    ops = defaultdict(list)
    for e in xs:
        if e.get("cat") == "cpu_op" and (e["pid"], e["tid"]) in threads and str(e["name"]).startswith("aten::"):
            ops[(e["pid"], e["tid"])].append(e)
    spans = {k: _outermost(v) for k, v in ops.items()}
    starts = {k: [a for a, _ in v] for k, v in spans.items()}
    inside = between = longest = 0.0
    count = 0
    for r in runs:
        k, lo, hi = (r["pid"], r["tid"]), r["ts"], r["ts"] + r["dur"]
        at = starts.get(k, [])
        mine = [(a, b) for a, b in spans.get(k, [])[bisect.bisect_left(at, lo):bisect.bisect_left(at, hi)] if b <= hi]
        idle = _gaps(mine, lo, hi)
        inside += length(mine)
        between += length(idle)
        count += len(mine)
        longest = max([longest] + [b - a for a, b in idle])
    return dict(in_ops_ms=round(inside / 1e3, 1), between_ops_ms=round(between / 1e3, 1), ops=count,
                longest_between_ms=round(longest / 1e3, 2))


def updates(events: list[dict], blocked: int = 12) -> list[dict]:
    """Per step, the chain of host-side updates it queued (the figures the module docstring lists for --updates)."""
    xs = [e for e in events if e.get("ph") == "X" and "dur" in e]
    # the markers on the host's threads (a marker around kernels has a twin on the GPU's lane: not those)
    named = lambda prefix: sorted((e for e in xs if str(e.get("name", "")).startswith(prefix)  # noqa: E731
                                   and e.get("cat") == "user_annotation"), key=lambda e: e["ts"])
    marks = named("pstar-fx step ")
    commits, queued = named("pstar-fx commit"), named("pstar-fx queue the host update of chunk ")
    waits, runs = named("pstar-fx wait for the copies of chunk "), named("pstar-fx host update of chunk ")
    if not queued:
        raise SystemExit("no 'pstar-fx queue the host update' markers: no host-side updates, or an older pstar-fx")
    main = (marks[0]["pid"], marks[0]["tid"])
    launches = [e for e in xs if (e["pid"], e["tid"]) == main and e.get("cat") == "cuda_runtime"
                and "correlation" in e.get("args", {})]
    gpu = _kernel_starts(xs)
    end = max(e["ts"] + e["dur"] for e in xs)
    out = []
    for i, m in enumerate(marks):
        lo, hi = m["ts"], marks[i + 1]["ts"] if i + 1 < len(marks) else end
        ms = lambda t: None if t is None else round((t - lo) / 1e3, 1)  # noqa: E731
        commit = next((e for e in commits if lo <= e["ts"] < hi), None)
        commit_gpu = None
        if commit is not None:
            inside = [gpu[e["args"]["correlation"]] for e in launches
                      if commit["ts"] <= e["ts"] <= commit["ts"] + commit["dur"] and e["args"]["correlation"] in gpu]
            commit_gpu = min(inside, default=None)
        mine = [q for q in queued if lo <= q["ts"] < hi]
        chain = []
        for q in mine:
            c = _chunk_of(q["name"])
            run = next((r for r in runs if r["ts"] >= q["ts"] and _chunk_of(r["name"]) == c), None)
            wait = next((w for w in waits if w["ts"] >= q["ts"] and _chunk_of(w["name"]) == c
                         and (run is None or w["ts"] <= run["ts"])), None)
            if run is not None:
                chain.append((q, wait, run))
        row = dict(step=i, commit_host_ms=ms(commit["ts"]) if commit else None, commit_gpu_ms=ms(commit_gpu),
                   queued=len(mine), queued_ms=[ms(mine[0]["ts"]), ms(mine[-1]["ts"])] if mine else None,
                   ran=len(chain))
        if commit is not None:     # where the executor's thread was held after the commit (5 ms or more)
            held = [e for e in xs if (e["pid"], e["tid"]) == main and commit["ts"] <= e["ts"] < hi
                    and (e.get("cat") in ("cuda_runtime", "cuda_driver") or e["name"] == "Command Buffer Full")
                    and e["dur"] >= 5e3]
            held = sorted(sorted(held, key=lambda e: -e["dur"])[:blocked], key=lambda e: e["ts"])
            row["held_after_commit"] = [(ms(e["ts"]), e["name"][:40], round(e["dur"] / 1e3, 1)) for e in held]
            row["held_after_commit_ms"] = round(sum(e["dur"] for e in held) / 1e3, 1)
        if chain:
            chain.sort(key=lambda t: t[2]["ts"])
            updating = sum(r["dur"] for _, _, r in chain)
            waiting = sum(w["dur"] for _, w, _ in chain if w is not None)
            span = chain[-1][2]["ts"] + chain[-1][2]["dur"] - chain[0][2]["ts"]
            row.update(first_update_ms=ms(chain[0][2]["ts"]), last_end_ms=ms(chain[-1][2]["ts"] + chain[-1][2]["dur"]),
                       updating_ms=round(updating / 1e3, 1), waiting_ms=round(waiting / 1e3, 1),
                       idle_ms=round((span - updating - waiting + (chain[0][1]["dur"] if chain[0][1] else 0)) / 1e3, 1),
                       first_wait_ms=round(chain[0][1]["dur"] / 1e3, 1) if chain[0][1] else 0.0,
                       **between_ops([r for _, _, r in chain], xs))
        out.append(row)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--gaps", type=int, default=8, help="the longest compute-idle stretches to show per step")
    ap.add_argument("--updates", action="store_true", help="the chain of host-side updates each step queued")
    ap.add_argument("--all", action="store_true", help="the steps with their gaps, then the update chains")
    args = ap.parse_args(argv)
    events = load(args.trace)
    if not args.updates or args.all:
        for s in read(events, args.gaps):
            gaps = s.pop("gaps")
            print(json.dumps(s))
            for g in gaps:
                print("   gap", json.dumps(g))
    if args.updates or args.all:
        for s in updates(events):
            print(json.dumps(s))


if __name__ == "__main__":
    main()
