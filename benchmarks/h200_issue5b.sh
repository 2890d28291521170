#!/usr/bin/env bash
# Second call of the issue 5 measurement: FSDP2 (its first call failed on a device without an index) and the
# 4.24B / 40 GiB pstar-fx profile again with the host's top operators.
set -u
out=${OUT:-h200_logs}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
start=$(date +%s)
python3 benchmarks/gpt.py --timeout 170 --json "$out/fsdp2_1b3_b8.json" --layers 24 --hidden 2048 --heads 16 --batch 8 --systems fsdp2 2>&1 | tee "$out/fsdp2_1b3_b8.txt" | grep -v '^{'
python3 benchmarks/gpt.py --timeout 170 --json "$out/gpt4b24_b4.json" --layers 20 --hidden 4096 --heads 32 --batch 4 --systems pstar,fsdp2 --budgets 40GiB --profile /tmp/prof 2>&1 | tee "$out/gpt4b24_b4.txt" | grep -v '^{'
f=/tmp/prof/pstar_40GiB.json.gz; [ -f "$f" ] && [ "$(stat -c %s "$f")" -lt 16000000 ] && cp "$f" "$out/"
ls -la /tmp/prof
echo "elapsed $(( $(date +%s) - start )) s"
