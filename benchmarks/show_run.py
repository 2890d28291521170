"""Print what benchmarks/gpt.py --json files hold: the short summaries the GPU suite keeps in its logs.

    python3 benchmarks/show_run.py RUN.json            # its rows (without profiles), and the children's step,
                                                       # host-memory and watch lines
    python3 benchmarks/show_run.py --brief RUN.json    # per row: the step, the compile's parts, the host pool and the
                                                       # per-step counters (gpu_suite.sh's 17B runs)
    python3 benchmarks/show_run.py --table A.json B.json ...   # one markdown table of every file's rows
"""
import json
import os
import sys

TABLE = ("system", "gpus", "params", "step_s", "tflops", "scaling", "peak_gpu", "predicted_peak", "peak_rss",
         "compile_s", "first_step_s")


def brief(d: dict) -> None:
    for r in d["rows"]:
        c = r.get("compile_parts", {})
        print({k: r.get(k) for k in ("system", "step_s", "tflops", "compile_s", "first_steps_s", "measured_peak",
                                     "predicted_peak", "cpu_worker_per_step")})
        print("compile:", {k: c.get(k) for k in ("trace_s", "passes_s", "setup_s", "rest_s", "import_s",
                                                 "host_waited_s")})
        print("host pool:", c.get("host_pool"))
        print("per step (populated GiB, worker updating s, allocator retries):",
              [(s.get("populated_gib"), s.get("updating_s"), s.get("num_alloc_retries")) for s in r.get("per_step", [])])


def table(paths: list[str]) -> None:
    print("| run | " + " | ".join(TABLE) + " |\n|" + "---|" * (len(TABLE) + 1))
    for path in paths:
        try:
            with open(path) as f:
                rows = json.load(f)["rows"]
        except (OSError, ValueError, KeyError) as e:
            print(f"| {os.path.basename(path)} | unreadable: {type(e).__name__} |")
            continue
        for r in rows:
            name = os.path.basename(path).removesuffix(".json")
            if "error" in r:
                print(f"| {name} | {r['system']} | {r['error'][:120]} |")
            else:
                print(f"| {name} | " + " | ".join(str(r.get(k, "-")) for k in TABLE) + " |")


def full(d: dict) -> None:
    for r in d["rows"]:
        print({k: v for k, v in r.items() if k != "profile"})
    for k, v in d["logs"].items():
        print(k, "\n".join(line for line in v.splitlines() if line.startswith(("step ", "host memory", "watch")))[-3000:])


def main(argv: list[str]) -> None:
    if argv[:1] == ["--table"]:
        return table(argv[1:])
    with open(argv[-1]) as f:
        d = json.load(f)
    if argv[:1] == ["--brief"]:
        return brief(d)
    try:
        full(d)
    except BrokenPipeError:       # piped into head: the rest is not wanted
        sys.stderr.close()


if __name__ == "__main__":
    main(sys.argv[1:])
