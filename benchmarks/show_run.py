"""Print a benchmarks/gpt.py --json file's rows (without profiles) and its children's step, host-memory and watch
lines: the short summary the GPU scripts keep in their logs. With --brief (before the file): per row the step, the
compile's parts, the host pool and per-step counters only (h200_prologue.sh's run17)."""
import json
import sys


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


d = json.load(open(sys.argv[-1]))
if sys.argv[1:2] == ["--brief"]:
    brief(d)
    sys.exit(0)
try:
    for r in d["rows"]:
        print({k: v for k, v in r.items() if k != "profile"})
    for k, v in d["logs"].items():
        print(k, "\n".join(line for line in v.splitlines() if line.startswith(("step ", "host memory", "watch")))[-3000:])
except BrokenPipeError:       # piped into head: the rest is not wanted
    sys.stderr.close()
