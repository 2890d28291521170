"""The main job, examples/train_gpt.py, runs from a checkout: the loss falls and the plan summary is printed."""
import re
import subprocess
import sys

import pytest

from ranks import ROOT


def test_train_gpt_example_trains_under_a_budget(tmp_path):
    out = subprocess.run([sys.executable, "examples/train_gpt.py", "--model", "tiny", "--steps", "60",
                          "--device", "cpu", "--log-every", "59", "--no-progress", "--out", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", text)]
    assert len(losses) >= 2 and losses[-1] < losses[0] - 1.0, text
    for field in ("chunks:", "budget:", "predicted peak:", "measured peak:", "moved per step:"):
        assert field in text, f"summary lacks {field!r}:\n{text}"
    predicted = re.search(r"predicted peak: (.*)", text).group(1)
    measured = re.search(r"measured peak: (.*)", text).group(1)
    assert predicted == measured
    budget = _bytes(re.search(r"device memory budget: (.*)", text).group(1))
    data = _bytes(re.search(r"model data \(.*\): (.*)", text).group(1))
    assert budget < data, "the default budget must be smaller than the model data"


def _bytes(s: str) -> float:
    value, unit = re.match(r"([\d.]+) (B|KiB|MiB|GiB)", s.strip()).groups()
    return float(value) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]


# the resume tests' common run: 40 steps of the tiny GPT, every step's loss logged
WHOLE = [sys.executable, "examples/train_gpt.py", "--model", "tiny", "--steps", "40", "--device", "cpu",
         "--log-every", "1", "--eval-every", "1000", "--no-progress"]


def _losses(text: str) -> dict[str, str]:
    return dict(re.findall(r"^step +(\d+) \| loss (\d+\.\d+)", text, re.M))


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory) -> dict[str, str]:
    """The uninterrupted run the resumed ones must equal: each step's loss, as printed."""
    out = subprocess.run([*WHOLE, "--out", str(tmp_path_factory.mktemp("whole"))], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    losses = _losses(out.stdout)
    assert sorted(map(int, losses)) == list(range(40)), out.stdout
    return losses


@pytest.mark.slow
def test_train_gpt_example_resumes_exactly(tmp_path, whole_run):
    """Stopped after step 19 and resumed with --resume in a new process: the same losses as one run of 40 steps
    (logged every 13 steps here: how often it logs changes no value)."""
    def run(*extra, out):
        res = subprocess.run([*WHOLE, "--log-every", "13", "--out", str(out), *extra], cwd=ROOT, capture_output=True,
                             text=True, timeout=300)    # (the later --log-every wins)
        assert res.returncode == 0, res.stderr[-3000:]
        return _losses(res.stdout)
    first = run("--stop-after", "19", out=tmp_path / "b")
    second = run("--resume", out=tmp_path / "b")
    assert set(first) == {"0", "13", "19"} and set(second) == {"26", "39"}
    for k in ("0", "13", "26", "39"):
        assert (first.get(k) or second.get(k)) == whole_run[k], (k, whole_run, first, second)


@pytest.mark.slow
def test_benchmark_finds_the_largest_gpt_each_system_trains():
    """benchmarks/gpt.py --largest tries the layer counts in turn per system and stops at the first failure: eager
    trains both tiny GPTs; pstar-fx at a budget below any plan's need trains none, and says why."""
    out = subprocess.run([sys.executable, "benchmarks/gpt.py", "--device", "cpu", "--tiny", "--systems", "eager,pstar",
                          "--budgets", "600KiB", "--largest", "1,2", "--warmup", "1", "--steps", "5"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = {line.split("|")[1].strip(): line for line in out.stdout.splitlines()
               if line.startswith("| eager:") and "largest" not in line and "layers)" in line
               or line.startswith("| pstar:600KiB | none")}
    assert "(2 layers)" in summary["eager:plain"] and "all trained" in summary["eager:plain"], out.stdout
    assert "1 layers: BudgetError" in summary["pstar:600KiB"], out.stdout


def test_benchmark_times_pstar_fx_and_reports_its_plan(tmp_path):
    """benchmarks/gpt.py's pstar-fx system on the CPU in bf16: its row has a step time, not an error, and its JSON
    the plan's and the run's figures (every GPU row of BENCHMARKS.md comes through this code)."""
    out = subprocess.run([sys.executable, "benchmarks/gpt.py", "--device", "cpu", "--tiny", "--systems", "pstar",
                          "--budgets", "none", "--precision", "bf16", "--warmup", "1", "--steps", "5",
                          "--json", str(tmp_path / "rows.json")], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    import json
    rows = json.load(open(tmp_path / "rows.json"))["rows"]
    assert len(rows) == 1 and "error" not in rows[0], rows
    row = rows[0]
    assert row["step_s"] > 0 and row["chunks"] > 0 and row["predicted_peak"] == row["measured_peak"] != "-"


@pytest.mark.slow
def test_train_gpt_example_saves_on_ctrl_c_and_resumes_exactly(tmp_path, whole_run):
    """Ctrl-C mid-run: the example saves a checkpoint of the steps done (pstar-fx completes or undoes the step it
    interrupts) and exits with 130; --resume then gives an uninterrupted run's losses; resuming a finished run
    trains nothing and still prints the plan."""
    import signal
    proc = subprocess.Popen([*WHOLE, "--out", str(tmp_path / "b")], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("step   10 "):
            proc.send_signal(signal.SIGINT)
            break
    rest, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-3000:]
    done = int(re.search(r"checkpoint of the (\d+) steps done", rest).group(1))
    assert 11 <= done < 40, rest
    resumed = subprocess.run([*WHOLE, "--out", str(tmp_path / "b"), "--resume"], cwd=ROOT, capture_output=True,
                             text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {tmp_path / 'b' / 'ckpt'} at step {done}" in resumed.stdout
    first, second, want = _losses("".join(seen) + rest), _losses(resumed.stdout), whole_run
    assert min(int(k) for k in second) == done and len(second) == 40 - done
    for k, v in {**first, **second}.items():
        assert v == want[k], (k, v, want[k])
    again = subprocess.run([*WHOLE, "--out", str(tmp_path / "b"), "--resume"], cwd=ROOT, capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "nothing left to train" in again.stdout and "predicted peak:" in again.stdout
