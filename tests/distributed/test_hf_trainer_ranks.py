"""PstarTrainer over several ranks (torchrun, gloo on the CPU) trains as the plain Trainer does with
DistributedDataParallel: each rank on its share of the batches (the Trainer's distributed sampler), pstar-fx's data
parallel step reducing the gradients in its sharded chunks. Against a plain Trainer on 2 ranks with the same model,
data and arguments (accumulation 2, clipping, warm-up, weight decay): every logged loss, grad norm and lr at 1e-5
(the suite's fp32 bound for a compiled step against eager), evaluate()'s loss, the final weights at WEIGHTS_ATOL.
Saving is a collective there: checkpoint-3 holds the Trainer's files (the optimizer's state dict gathered from the
ranks' shards, written by rank 0) and the step's sharded checkpoint, and a new PstarTrainer resuming from it
continues bit for bit; save_model writes safetensors that from_pretrained loads.
"""
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import GPT2LMHeadModel  # noqa: E402

from ranks import run_ranks  # noqa: E402

pytestmark = pytest.mark.slow

WORLD = 2
# The final weights against DDP's. The ranks' gradients are summed in another order than DDP's (its buckets against
# pstar-fx's chunks), and Adam turns the last-bit differences of near-zero gradients into visible ones: GPT-2's key
# bias, whose exact gradient is 0 (the softmax ignores it), ends 3.4e-6 apart; every other tensor within 1e-6.
WEIGHTS_ATOL = 1e-5


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf_ranks")
    out = str(tmp / "result")
    launched = run_ranks("hf_trainer_ranks_worker.py", [out], WORLD, out, timeout=400)
    for r, res in enumerate(launched.results):
        assert "error" not in res, f"rank {r}: {res['error'][2]}"
    return launched.results


def _steps(logs):
    return [log for log in logs if "loss" in log and "train_loss" not in log]


def test_trains_like_the_plain_trainer_with_ddp(ranks):
    for r, res in enumerate(ranks):
        plain, pstar = _steps(res["plain"]["logs"]), _steps(res["pstar"]["logs"])
        assert len(plain) == len(pstar) == 8, (r, plain, pstar)     # 64 / (4 x 2 x 2): 4 steps an epoch, 2 epochs
        for a, b in zip(pstar, plain):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (r, a, b)
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), (r, a, b)
            assert a["learning_rate"] == b["learning_rate"]
        assert pstar[-1]["loss"] < pstar[0]["loss"]
        # evaluations at steps 4 and 8, and evaluate() after train()
        evals = [[log["eval_loss"] for log in res[name]["logs"] if "eval_loss" in log] for name in ("pstar", "plain")]
        assert len(evals[0]) == len(evals[1]) == 3 and evals[0] == pytest.approx(evals[1], rel=1e-5), (r, evals)
        # one trace: neither the evaluations nor the saves change what the step's compile key reads of the model
        assert res["pstar"]["compiles"] == 1, (r, res["pstar"]["compiles"])
        for k, v in res["plain"]["state"].items():
            torch.testing.assert_close(res["pstar"]["state"][k], v, rtol=0, atol=WEIGHTS_ATOL,
                                       msg=lambda m, k=k: f"{k}: {m}")
        assert res["pstar"]["eval"]["eval_loss"] == pytest.approx(res["plain"]["eval"]["eval_loss"], rel=1e-5)
    # the ranks hold one model
    for k, v in ranks[0]["pstar"]["state"].items():
        assert torch.equal(ranks[1]["pstar"]["state"][k], v), k


def test_batches_padded_per_batch_are_padded_to_the_longest_over_the_ranks(ranks):
    """A collator's dynamic padding gives the ranks batches of other lengths; the pstar-fx step needs one shape on
    every rank, so each batch is padded (masked) to the longest over the ranks: the plain Trainer's losses, grad
    norms and evaluations (weights at 1e-4: other shapes sum in another order, as tests/integration/test_hf_trainer.py
    says of padding in one process)."""
    for r, res in enumerate(ranks):
        plain, pstar = res["plain-padded"]["logs"], res["pstar-padded"]["logs"]
        assert len(plain) == len(pstar) and sum("eval_loss" in log for log in pstar) == 2, (r, pstar)
        for a, b in zip(pstar[:-1], plain[:-1]):
            for k in ("loss", "grad_norm", "eval_loss"):
                if k in b:
                    assert a[k] == pytest.approx(b[k], rel=1e-5), (r, k, a, b)
        for k, v in res["plain-padded"]["state"].items():
            torch.testing.assert_close(res["pstar-padded"]["state"][k], v, rtol=0, atol=1e-4, msg=k)


def test_a_checkpoint_resumes_bit_for_bit_on_every_rank(ranks):
    dirs = ranks[0]["dirs"]
    ckpt = os.path.join(dirs["pstar"], "checkpoint-3")
    assert sorted(n for n in os.listdir(os.path.join(ckpt, "pstar_fx")) if n.endswith(".distcp")) == \
        ["__0_0.distcp", "__1_0.distcp"]                                    # each rank wrote its own pieces
    for name in ("model.safetensors", "optimizer.pt", "scheduler.pt"):
        assert os.path.isfile(os.path.join(ckpt, name)), name
    optimizer = torch.load(os.path.join(ckpt, "optimizer.pt"), weights_only=True)
    assert len(optimizer["state"]) == sum(1 for _ in GPT2LMHeadModel.from_pretrained(ckpt).parameters())
    assert all(float(s["step"]) == 3 for s in optimizer["state"].values())
    for r, res in enumerate(ranks):
        whole = {round(log["epoch"], 3): log["loss"] for log in _steps(res["pstar"]["logs"])}
        again = {round(log["epoch"], 3): log["loss"] for log in _steps(res["resumed"]["logs"])}
        assert len(again) == 5 and all(again[e] == whole[e] for e in again), (r, whole, again)
        for k, v in res["pstar"]["state"].items():
            assert torch.equal(res["resumed"]["state"][k], v), (r, k)


def test_save_model_writes_the_trained_values(ranks):
    saved = GPT2LMHeadModel.from_pretrained(os.path.join(ranks[0]["dirs"]["pstar"], "final"))
    trained = ranks[0]["pstar"]["state"]
    for k, v in saved.state_dict().items():
        assert torch.equal(v, trained[k]), k


def test_a_failure_on_one_rank_ends_every_rank(tmp_path):
    """A callback raising on rank 0 alone: rank 0 exits with its error (it does not wait in a collective to give the
    model back, which the other rank never joins) and the other rank fails in the Trainer's next collective, as a
    plain Trainer's ranks do; none waits for the process group's timeout."""
    out = str(tmp_path / "result")
    launched = run_ranks("hf_trainer_ranks_worker.py", [out, "fail"], WORLD, out, timeout=120, failing=(0, 1))
    assert launched.results[0]["error"][:2] == ("RuntimeError", "a failure on rank 0 alone")
    assert launched.wall < 100
