"""The publish gate and the model's `current` snapshot pointer.

Pure: `decide` (AUC drop and log-loss rise limits), `GateConfig` validation, the pointer's
atomic moves. Real: two tiny DLRMs trained by a spawned gloo rank (`helpers.training`, 3
epochs over one window), one on the real labels and one on the same rows with shuffled
labels; the first is published (the model's first snapshot: `current` points at it), the
shuffled one is installed but GATED (its held-out AUC is far worse) and `current` does not
move; a snapshot as good as the current one passes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch.multiprocessing as mp

from ettflow.ett.lineage import Outcome
from ettflow.publish.gate import GateConfig, PublishOutcome, Scores, decide
from ettflow.trainer.data.schema import criteo_schema
from ettflow.trainer.model import ModelConfig

from helpers.training import AnchorRun, train_and_anchor

SCHEMA = criteo_schema(64)
MODEL = ModelConfig(embedding_dim=4, dense_arch=(8, 4), over_arch=(8, 1), dense_lr=0.02, sparse_lr=0.1)
GOOD, HELD_OUT, SHUFFLED = "window=2024010100", "window=2024010101", "window=2024010102"
BATCH = 128


# ---- pure -----------------------------------------------------------------------------------
def test_decide_gates_on_an_auc_drop_or_a_log_loss_rise_beyond_the_limits():
    current = Scores(auc=0.70, logloss=0.50)
    assert decide(Scores(auc=0.695, logloss=0.9), current, GateConfig())[0] is Outcome.PUBLISHED
    outcome, reason = decide(Scores(auc=0.68, logloss=0.5), current, GateConfig(max_auc_drop=0.01))
    assert outcome is Outcome.GATED and "gate_max_auc_drop 0.01" in reason and "0.6800" in reason
    both = GateConfig(max_auc_drop=None, max_logloss_increase=0.01)
    assert decide(Scores(auc=0.5, logloss=0.505), current, both)[0] is Outcome.PUBLISHED
    outcome, reason = decide(Scores(auc=0.9, logloss=0.52), current, both)
    assert outcome is Outcome.GATED and "gate_max_logloss_increase" in reason
    assert decide(Scores(auc=0.9, logloss=float("nan")), current, both)[0] is Outcome.GATED
    outcome, reason = decide(Scores(auc=None, logloss=0.5), current, GateConfig())  # one class: no AUC
    assert outcome is Outcome.PUBLISHED and "one class" in reason
    off = GateConfig(max_auc_drop=None, max_logloss_increase=None)
    assert decide(Scores(auc=0.1, logloss=9.0), current, off) == (
        Outcome.PUBLISHED, "the gate is off (gate_max_auc_drop and gate_max_logloss_increase are null)")
    with pytest.raises(ValueError, match="max_auc_drop"):
        GateConfig(max_auc_drop=-0.1)
    with pytest.raises(ValueError, match="published or gated"):
        PublishOutcome(snapshot="s", outcome=Outcome.SKIPPED, reason="r")


# ---- real -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def anchors(tmp_path_factory):
    from ettflow.trainer.data.synthetic import SyntheticConfig, generate_windows, write_window

    root = tmp_path_factory.mktemp("gate")
    generate_windows(root / "data", SyntheticConfig(windows=2, rows_per_window=4096, files_per_window=1, seed=5))
    good = pq.read_table(next((root / "data" / GOOD).glob("*.parquet")))
    labels = np.random.default_rng(0).permutation(good.column("label").to_numpy())
    shuffled = good.set_column(good.schema.get_field_index("label"), "label", pa.array(labels))
    write_window(shuffled, root / "data" / SHUFFLED, files=1, row_group_size=None, overwrite=False)
    anchors = {}
    for window, name in ((GOOD, "good"), (SHUFFLED, "shuffled")):
        run = AnchorRun(root=str(root), name=name, model=MODEL, schema=SCHEMA, windows=(window,), batch_size=BATCH,
                        epochs=3)
        mp.spawn(train_and_anchor, args=(run,), nprocs=1, join=True)
        anchors[name] = run.anchor_dir()
    return root, anchors


def _publish(root: Path, anchor: Path, run_id: str, out: Path) -> PublishOutcome:
    from ettflow.publish import PublishConfig, publish_snapshot
    from ettflow.publish.gate import gate_snapshot

    config = PublishConfig(anchor=anchor, output_root=out, data_root=root / "data", windows=(HELD_OUT,),
                           batch_size=256, validation_batches=4, run_id=run_id)
    return gate_snapshot(publish_snapshot(config), config, GateConfig(max_auc_drop=0.01))


def test_a_snapshot_trained_on_shuffled_labels_is_gated_and_current_stays(anchors, tmp_path):
    from ettflow.publish import read_current, read_manifest

    root, anchor = anchors
    out = tmp_path / "snapshots"
    first = _publish(root, anchor["good"], "good", out)
    assert first.outcome is Outcome.PUBLISHED and "first snapshot" in first.reason
    pointer = read_current(out)
    assert pointer.path == first.snapshot == first.current and pointer.anchor == str(anchor["good"].resolve())
    assert read_manifest(first.snapshot).lineage["windows"] == [GOOD]
    before = (out / "current").read_bytes()

    bad = _publish(root, anchor["shuffled"], "shuffled", out)
    assert bad.gated and bad.outcome is Outcome.GATED, bad.reason
    assert bad.metrics["new"]["auc"] < bad.metrics["current"]["auc"] - 0.01
    assert "gate_max_auc_drop" in bad.reason and bad.message.startswith("gated: ")
    assert bad.current == first.snapshot and Path(bad.snapshot).is_dir()  # installed, not current
    assert (out / "current").read_bytes() == before and read_current(out) == pointer

    # a snapshot as good as the current one passes, and `current` moves to it atomically
    again = _publish(root, anchor["good"], "good-again", out)
    assert again.outcome is Outcome.PUBLISHED and "vs current" in again.reason
    assert read_current(out).path == again.snapshot and json.loads((out / "current").read_text())["snapshot"] \
        == "good-again"
    assert not list(out.glob(".current.tmp-*"))

    # a passing snapshot whose move is refused by the caller's guard (the flow's: its run lost its
    # claims) leaves `current` where it was, and the guard's error is raised
    from ettflow.publish import PublishConfig
    from ettflow.publish import read_manifest as manifest_of
    from ettflow.publish.gate import gate_snapshot

    class Refused(RuntimeError):
        pass

    entered = []

    def refuse(outcome):
        entered.append(outcome.outcome)
        raise Refused("this run no longer holds its windows")

    before = (out / "current").read_bytes()
    config = PublishConfig(anchor=anchor["good"], output_root=out, data_root=root / "data", windows=(HELD_OUT,),
                           batch_size=256, validation_batches=4, run_id="good")
    with pytest.raises(Refused):
        gate_snapshot(manifest_of(first.snapshot), config, GateConfig(max_auc_drop=0.01), guard=refuse)
    assert entered == [Outcome.PUBLISHED] and (out / "current").read_bytes() == before


def test_a_delta_snapshot_materializes_to_the_full_snapshot_and_scores_the_same(anchors, tmp_path):
    """Issue 28: the "good" model published as a delta on the "shuffled" one's snapshot holds only
    the rows that changed (no model file); validated as the full snapshot is, the gate scores it
    materialized, and `materialize` writes the full module: its state is the full snapshot's bit
    for bit, so it scores the same AUC. A delta on that delta (the same model again) changes no
    row and materializes through the chain; a damaged delta is refused, and the next publish on
it is stored full and gated without a comparison."""
    import torch

    from ettflow.publish import PublishConfig, PublishError, move_current, publish_snapshot, read_current
    from ettflow.publish.config import SnapshotValidationError
    from ettflow.publish.delta_snapshot import load_module, materialize
    from ettflow.publish.gate import gate_snapshot, score_snapshot

    root, anchor = anchors
    out = tmp_path / "snapshots"

    def config(which: str, run_id: str, **kw) -> PublishConfig:
        return PublishConfig(anchor=anchor[which], output_root=out, data_root=root / "data", windows=(HELD_OUT,),
                             batch_size=256, validation_batches=4, run_id=run_id, **kw)

    base = publish_snapshot(config("shuffled", "base"))
    full = publish_snapshot(config("good", "full"))
    delta = publish_snapshot(config("good", "delta", delta_on=base.path))
    assert delta.delta["base"] == str(Path(base.path).resolve()) and sorted(delta.files) == ["delta-0.bin",
                                                                                            "delta-0.json"]
    assert 0 < delta.delta["changed_rows"] <= delta.delta["rows"] == 26 * 64
    assert delta.metrics == full.metrics  # validated as the full snapshot
    made = materialize(delta.path, tmp_path / "materialized")
    want = load_module(Path(full.path) / "model.pt").state_dict()
    got = load_module(Path(made.path) / "model.pt").state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    # the gate scores the delta materialized: the full snapshot's AUC and log loss (the same state, above)
    scored = score_snapshot(delta.path, config("good", "x"), SCHEMA)
    assert (scored.auc, scored.logloss) == (full.metrics["auc_snapshot"], full.metrics["logloss_snapshot"])
    again = publish_snapshot(config("good", "again", delta_on=delta.path))  # a chain of two deltas
    assert again.delta["changed_rows"] == 0 and again.delta["bytes"] < delta.delta["bytes"]
    twice = load_module(Path(materialize(again.path, tmp_path / "m2").path) / "model.pt").state_dict()
    assert all(torch.equal(want[k], twice[k]) for k in want)
    print(f"\ndelta snapshot: {delta.delta['changed_rows']} of {delta.delta['rows']} rows, {delta.delta['bytes']} "
          f"bytes vs {delta.delta['full_bytes']} for the full module")
    # the rebuild check: a delta whose rebuilt module predicts otherwise (here: the base's own
    # module, as if the delta lost its rows) is refused, and nothing is installed
    import ettflow.publish.delta_snapshot as delta_snapshot

    write = delta_snapshot.write_delta_snapshot

    def lossy(base_folder, new_model, folder, *, rebuilt):
        out = write(base_folder, new_model, folder, rebuilt=rebuilt)
        rebuilt.write_bytes((Path(base.path) / "model.pt").read_bytes())
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(delta_snapshot, "write_delta_snapshot", lossy)
        with pytest.raises(SnapshotValidationError, match="rebuilt from its delta .* predicts differently"):
            publish_snapshot(config("good", "lossy", delta_on=base.path))
    assert not (out / "lossy").exists()
    part = Path(delta.path) / "delta-0.bin"
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.raises(PublishError, match="does not match its manifest"):
        materialize(again.path, tmp_path / "m3")
    # a broken link fails neither the next publish nor its gate: the snapshot is stored full (a
    # new chain), and a current snapshot whose chain cannot be scored is not compared with
    after = publish_snapshot(config("good", "after", delta_on=again.path))
    assert "model.pt" in after.files and not after.delta.get("base") and not after.delta["new_base"]
    assert "cannot be materialized" in after.delta["refused"]  # the manifest says why it is full
    move_current(out, again)
    outcome = gate_snapshot(after, config("good", "after"), GateConfig(max_auc_drop=0.01))
    assert outcome.outcome is Outcome.PUBLISHED and "cannot be compared" in outcome.reason
    assert read_current(out).path == after.path
