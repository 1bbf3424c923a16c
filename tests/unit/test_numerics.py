"""Non-finite training state as a typed `numerics` failure, the anchor marker's format, and
publish's advice for a checkpoint that holds non-finite values. Pure: no cluster."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch

from ettflow.ett.failures import FailureClass, FailureError
from ettflow.ett.spool import SpoolWriter, read_spool
from ettflow.trainer.checkpoint.anchor import (
    ANCHOR_FILE,
    AnchorFormatError,
    AnchorInfo,
    load_anchor,
    read_anchor,
    write_anchor,
)
from ettflow.trainer.config import FailAt
from ettflow.trainer.data.schema import criteo_schema
from ettflow.trainer.model import ModelConfig
from ettflow.trainer.rank.numerics import loss_failure, nonfinite_parameters, poison, refuse_nonfinite

SCHEMA = criteo_schema(10)
MODEL = ModelConfig(embedding_dim=4, dense_arch=(8, 4), over_arch=(8, 1))


def named(*tensors):
    return [(f"p{i}", t) for i, t in enumerate(tensors)]


def test_a_non_finite_loss_is_a_numerics_failure():
    assert loss_failure(0.69, rank=0, step=3) is None
    for bad in (float("nan"), float("inf"), float("-inf")):
        f = loss_failure(bad, rank=1, step=7, injected=True)
        assert f.failure_class is FailureClass.NUMERICS and f.rank == 1 and f.step == 7 and f.injected
        assert f.reason == "non-finite loss at step 7 on rank 1"


def test_non_finite_parameters_are_named():
    ok, nan, inf = torch.ones(3), torch.tensor([1.0, float("nan")]), torch.tensor([float("inf")])
    assert nonfinite_parameters(named(ok, ok)) == [] and nonfinite_parameters([]) == []
    assert nonfinite_parameters(named(ok, nan, ok, inf)) == ["p1", "p3"]
    params = [torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2))]
    poison(params)  # the scripted `nan` fault
    assert nonfinite_parameters(named(*params)) == ["p0"]
    assert FailAt.parse("nan:rank=0:step=5").kind == "nan"


def test_a_save_from_non_finite_state_is_refused_and_recorded(tmp_path):
    good, bad = named(torch.ones(2)), named(torch.ones(2), torch.tensor([float("nan")]))
    with SpoolWriter(tmp_path, "r", 0, 1) as rec:
        refuse_nonfinite(rec, good, rank=1, step=10, loss=0.5, action="checkpoint at step 10")
        refuse_nonfinite(rec, good, rank=1, step=10, loss=None, action="anchor at step 10")  # nothing trained
        with pytest.raises(FailureError) as params_err:
            refuse_nonfinite(rec, bad, rank=1, step=10, loss=0.5, action="checkpoint at step 10")
        with pytest.raises(FailureError) as loss_err:
            refuse_nonfinite(rec, good, rank=1, step=12, loss=float("nan"), action="anchor at step 12")
    f = params_err.value.failure
    assert f.failure_class is FailureClass.NUMERICS and f.step == 10 and f.rank == 1
    assert "checkpoint at step 10 refused" in f.reason and "p1" in f.detail
    assert loss_err.value.failure.reason == "non-finite loss at step 12 on rank 1: anchor at step 12 refused"
    markers = [e for e in read_spool(tmp_path, "r").events if e.phase == "failure"]
    assert [(m.attrs["failure_class"], m.attrs["step"], m.attrs["failed_rank"]) for m in markers] == [
        ("numerics", 10, 1), ("numerics", 12, 1)]


def anchor_info(**over) -> AnchorInfo:
    return AnchorInfo(**{"run_id": "run-a", "step": 24, "world_size": 2, "model": MODEL, "schema": SCHEMA,
                         "cursor": {"window": 1, "file": 0, "row": 64}, **over})


def test_anchor_json_keeps_its_keys_and_reads_back(tmp_path):
    write_anchor(tmp_path, anchor_info())
    raw = json.loads((tmp_path / ANCHOR_FILE).read_text())
    assert raw == {"run_id": "run-a", "step": 24, "world_size": 2, "cursor": {"window": 1, "file": 0, "row": 64},
                   "model": json.loads(json.dumps(asdict(MODEL))), "schema": SCHEMA.to_dict()}
    assert read_anchor(tmp_path) == raw and load_anchor(tmp_path) == anchor_info()
    # a marker written as a plain dict (the format before AnchorInfo) reads back the same
    write_anchor(tmp_path, {**raw, "step": 25})
    assert load_anchor(tmp_path) == anchor_info(step=25)
    assert load_anchor(tmp_path / "elsewhere") is None and read_anchor(tmp_path / "elsewhere") is None


@pytest.mark.parametrize("change, match", [
    ({"step": None}, r"lacks \['step'\]"),
    ({"model": {**asdict(MODEL), "depth": 3}}, r"fields \['depth'\]"),
    ({"model": {**asdict(MODEL), "embedding_dim": 5}}, "invalid model config"),
    ({"schema": {"dense": []}}, "invalid schema"),
    ({"step": -1}, "step must be an int >= 0"),
])
def test_a_malformed_anchor_names_the_file_and_field(tmp_path, change, match):
    raw = anchor_info().to_json() | change
    raw = {k: v for k, v in raw.items() if v is not None}
    (tmp_path / ANCHOR_FILE).write_text(json.dumps(raw))
    with pytest.raises(AnchorFormatError, match=match) as err:
        load_anchor(tmp_path)
    assert str(tmp_path / ANCHOR_FILE) in str(err.value)
    with pytest.raises(AnchorFormatError, match=match):
        write_anchor(tmp_path, raw)  # never written either


def test_publish_blames_non_finite_checkpoint_not_quantization():
    from ettflow.publish.anchor import NonFiniteCheckpointError
    from ettflow.publish.config import AnchorError, SnapshotValidationError
    from ettflow.publish.validate import compare

    labels = torch.tensor([0.0, 1.0, 1.0, 0.0])
    reference = torch.tensor([0.2, 0.7, float("nan"), 0.1])
    with pytest.raises(NonFiniteCheckpointError, match="checkpoint holds non-finite values") as err:
        compare(reference, torch.tensor([0.2, 0.7, 0.5, 0.1]), labels, tolerance=0.02)
    assert isinstance(err.value, AnchorError) and not err.value.retryable and "quantize" not in str(err.value)
    # a finite model whose snapshot drifts still gets the quantization advice
    with pytest.raises(SnapshotValidationError, match="quantize off"):
        compare(torch.tensor([0.2, 0.7, 0.6, 0.1]), torch.tensor([0.2, 0.7, float("nan"), 0.1]), labels, 0.02)
    assert compare(reference.nan_to_num(0.5), reference.nan_to_num(0.5), labels, 0.02)["max_abs_diff"] == 0.0
