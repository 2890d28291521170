"""Ranks that disagree are refused before any collective could pair wrongly: two gloo ranks on the CPU, every
scenario in one launch (tests/support/dist_checks_worker.py; process start-up dominates).

- Different batch sizes on the two ranks: px.DistributedError on both, naming both shapes; the step then trains as
  if the refused call never ran (equal to eager on the global batch). The same for a forward-only function.
- A rank changing its batch shape at the third step while the other does not: the same error on both ranks.
- Models built from different seeds (plainly, and under px.init_empty()): refused, naming exactly the parameters
  that differ (the Linear layers', not the LayerNorm's, which every seed makes the same) and the ranks.
- The same seed: trains, plainly and under px.init_empty() alike.
- The process group, destroyed by the user while compiled steps are alive, is gone then (pstar-fx keeps no
  reference that would leave its teardown, and gloo's threads, to interpreter exit).
In one process: the digests the ranks compare change exactly where the values do (real tensors: any element, the
shape; a model built under px.init_empty(): the RNG state its random ops draw from, a real tensor it reads).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import pstar_fx as px
from pstar_fx.api.agreement import _value_digests
from pstar_fx.frontend.init_empty import origin_digests
from harness import rel_err
from models import assert_state_close
from ranks import run_ranks
from test_distributed import eager_reference

pytestmark = pytest.mark.slow

WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = str(tmp_path_factory.mktemp("checks") / "result")
    return run_ranks("dist_checks_worker.py", ["--out", out, "--timeout", 30], WORLD, out, timeout=180).results


def test_different_batch_sizes_are_refused_on_every_rank(ranks):
    ref_losses, _, ref_sd = eager_reference("mlp_ce", 4, 2, world=WORLD)
    for r, res in enumerate(ranks):
        rec = res["batch_sizes"]
        assert "error" not in rec, f"rank {r}: {rec['error'][2]}"
        msg = rec.get("refused")
        assert msg is not None, f"rank {r} trained on a batch of a size the other rank did not have"
        assert "batch[0] (2, 16) float32" in msg and "batch[0] (3, 16) float32" in msg, msg
        assert "rank 0: batch[0] (2, 16)" in msg and "rank 1: batch[0] (3, 16)" in msg, msg
        assert rel_err(rec["losses"], ref_losses) <= 1e-6, (rec["losses"], ref_losses)
        assert_state_close(rec["state_dict"], ref_sd, rtol=1e-6)


def test_an_evaluation_with_different_batch_sizes_is_refused(ranks):
    for r, res in enumerate(ranks):
        rec = res["batch_sizes"]
        assert "error" not in rec, f"rank {r}: {rec['error'][2]}"
        msg = rec.get("eval_refused")
        assert msg is not None and "rank 0: batch[0] (2, 16)" in msg and "rank 1: batch[0] (3, 16)" in msg, msg
    assert ranks[0]["batch_sizes"]["eval_loss"] != ranks[1]["batch_sizes"]["eval_loss"], "each rank its own rows"


def test_a_rank_changing_its_batch_shape_later_is_refused_on_every_rank(ranks):
    for r, res in enumerate(ranks):
        rec = res["shape_change"]
        assert len(rec["losses"]) == 2, (r, rec["losses"])
        assert "error" in rec, f"rank {r} ran the third step"
        name, msg, _ = rec["error"]
        assert name == "DistributedError", rec["error"]
        assert "rank 0: batch[0] (2, 16)" in msg and "rank 1: batch[0] (1, 16)" in msg, msg
        assert "batch[1] (2,) int64" in msg and "batch[1] (1,) int64" in msg, msg


@pytest.mark.parametrize("kind", ["plain", "empty"])
def test_models_built_from_different_seeds_are_refused(ranks, kind):
    for r, res in enumerate(ranks):
        rec = res[f"seeds_{kind}"]
        assert rec["losses"] == [], f"rank {r} trained a mix of the ranks' models"
        name, msg, _ = rec["error"]
        assert name == "DistributedError", rec["error"]
        assert "different values of 4 of the model's 6 parameters and buffers" in msg, msg
        for p in ("0.weight", "0.bias", "3.weight", "3.bias"):
            assert f"{p} (rank 0 | rank 1)" in msg, msg
        assert "1.weight" not in msg and "1.bias" not in msg, msg
        assert "torch.manual_seed" in msg


def test_state_a_step_sets_up_traces_again_on_every_rank_or_is_refused_where_one_rank_sets_it(ranks):
    """Set on every rank, the state makes every rank trace the second step, which takes the first plan; set on
    rank 0 only, rank 0 would trace where rank 1 runs compiled: refused on both, before any collective could pair
    with another (a hang before)."""
    for r, res in enumerate(ranks):
        rec = res["state_every_rank"]
        assert "error" not in rec, f"rank {r}: {rec['error'][2]}"
        assert len(rec["losses"]) == 3 and (rec["traces"], rec["plans"]) == (2, 1), rec
        rec = res["state_rank_0"]
        assert len(rec["losses"]) == 1 and "error" in rec, (r, rec)
        name, msg, _ = rec["error"]
        assert name == "DistributedError", rec["error"]
        assert "rank 0: traces it" in msg and "rank 1: runs it compiled" in msg and "every rank alike" in msg, msg


def test_models_built_from_the_same_seed_train(ranks):
    plain = [res["same_seed_plain"] for res in ranks]
    empty = [res["same_seed_empty"] for res in ranks]
    for r in range(WORLD):
        for rec in (plain[r], empty[r]):
            assert "error" not in rec, f"rank {r}: {rec['error'][2]}"
            assert len(rec["losses"]) == 2
    assert plain[0]["losses"] == plain[1]["losses"] == empty[0]["losses"] == empty[1]["losses"]
    assert plain[0]["losses"][1] != plain[0]["losses"][0]


def test_destroying_the_process_group_ends_it_while_steps_are_alive(ranks):
    for r, res in enumerate(ranks):
        assert res["steps_alive"] >= 6
        assert res["groups_alive_after_destroy"] == [False, False], (r, res["groups_alive_after_destroy"])


def test_value_digests_change_with_any_element_and_the_shape():
    g = torch.Generator().manual_seed(0)
    values = {"w": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g).bfloat16(),
              "mask": torch.rand(5, generator=g) > 0.5, "t": torch.randn(4, 3, generator=g).t()}
    same = _value_digests({k: v.clone() for k, v in values.items()})
    assert same == _value_digests(values)
    nudged = values["w"].clone()
    nudged[1, 2] = torch.nextafter(nudged[1, 2], torch.tensor(1e9))
    assert _value_digests({"w": nudged})["w"] != same["w"]
    assert _value_digests({"w": values["w"].reshape(4, 3)})["w"] != same["w"]
    assert _value_digests({"t": values["t"].contiguous()})["t"] == same["t"]


class _Reseeded(nn.Module):
    """`a` draws from the caller's seed; after a manual_seed inside the build, `b` draws the same whatever it was;
    `scale` is computed from a real tensor given as data."""

    def __init__(self, data):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        torch.manual_seed(5)
        self.b = nn.Linear(8, 8)
        self.register_buffer("scale", torch.tensor(data) * torch.ones(2))


def _origins(seed: int, data) -> dict[str, bytes]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with px.init_empty():
            model = _Reseeded(data)
    return origin_digests(dict(model.named_parameters()) | dict(model.named_buffers()))


def test_origin_digests_of_an_empty_model_follow_what_its_values_are_made_from():
    base = _origins(1, [1.0, 2.0])
    assert len(base) == 7 and base == _origins(1, [1.0, 2.0])
    other_seed = _origins(2, [1.0, 2.0])
    assert sorted(n for n in base if base[n] != other_seed[n]) == ["a.bias", "a.weight"]
    other_data = _origins(1, [1.0, 3.0])
    assert sorted(n for n in base if base[n] != other_data[n]) == ["scale"]


def test_batch_norm_statistics_are_rank_0s_on_every_rank_and_sync_model_keeps_training(ranks):
    """Each rank's running statistics come from its own rows; after each step every rank holds rank 0's (DDP's
    broadcast_buffers), so the ranks keep one model: sync_model() and the next step's agreement check pass."""
    recs = [res["batch_norm"] for res in ranks]
    for r, rec in enumerate(recs):
        assert "error" not in rec, f"rank {r}: {rec['error'][2]}"
        assert len(rec["losses"]) == 3, (r, rec["losses"])
    a, b = recs[0]["buffers"], recs[1]["buffers"]
    assert a.keys() == b.keys() == {"1.running_mean", "1.running_var"}
    assert all(torch.equal(a[k], b[k]) for k in a) and not torch.equal(a["1.running_mean"], torch.zeros(32))


def test_ranks_with_different_architectures_are_told_the_parameters_differ(ranks):
    for r, res in enumerate(ranks):
        rec = res["architecture"]
        assert rec["losses"] == [], f"rank {r} trained"
        name, msg, _ = rec["error"]
        assert name == "DistributedError", rec["error"]
        assert "the model's parameters: rank 0: 4 tensors of 808 elements" in msg, msg
        assert "rank 1: 4 tensors of 408 elements" in msg and "the same parameters and shapes" in msg, msg
