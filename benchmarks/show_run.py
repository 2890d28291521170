"""Print a benchmarks/gpt.py --json file's rows (without profiles) and its children's step, host-memory and watch
lines: the short summary the GPU scripts keep in their logs."""
import json
import sys

d = json.load(open(sys.argv[1]))
try:
    for r in d["rows"]:
        print({k: v for k, v in r.items() if k != "profile"})
    for k, v in d["logs"].items():
        print(k, "\n".join(line for line in v.splitlines() if line.startswith(("step ", "host memory", "watch")))[-3000:])
except BrokenPipeError:       # piped into head: the rest is not wanted
    sys.stderr.close()
