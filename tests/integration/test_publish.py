"""Publishing on CPU: a 2-rank anchor checkpoint -> one-process int8 TorchScript snapshot.

A module fixture trains a tiny sharded DLRM for a few steps on 2 gloo ranks, saves the anchor
checkpoint through CheckpointManager (sync) and marks it with write_anchor (`helpers.training`);
every rank then runs the sharded model on a held-out batch and rank 0 keeps its predictions,
so the one-process load (resharding from 2 ranks) is checked against the model as it was
trained.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from ettflow.trainer.data.schema import criteo_schema
from ettflow.trainer.model import ModelConfig

from helpers.training import AnchorRun, train_and_anchor

WORLD, BATCH, STEPS = 2, 64, 4
SCHEMA = criteo_schema(64)
MODEL = ModelConfig(embedding_dim=4, dense_arch=(8, 4), over_arch=(8, 1))
TRAIN_WINDOW, HELD_OUT = "window=2024010100", "window=2024010101"
RUN_ID = "run-publish-test"

def _keep_held_out_predictions(rank: int, run: AnchorRun, sharded, anchor: Path) -> None:
    """The sharded model's predictions on one held-out batch (every rank feeds the same one)."""
    from ettflow.trainer.data.pipeline import DataConfig, DataPipeline

    held = next(DataPipeline(DataConfig(root=f"{run.root}/data", schema=SCHEMA, batch_size=2 * BATCH,
                                        windows=(HELD_OUT,))).batches())
    with torch.no_grad():
        _, logits = sharded.step_fn(held.dense, sharded.dmp.module.sparse_arch(held.sparse), held.labels)
    if rank == 0:
        torch.save({"dense": held.dense, "values": held.sparse.values(), "lengths": held.sparse.lengths(),
                    "probs": torch.sigmoid(logits)}, f"{run.root}/trained_probs.pt")


@pytest.fixture(scope="module")
def anchor(tmp_path_factory) -> Path:
    from ettflow.trainer.data.synthetic import SyntheticConfig, generate_windows

    root = tmp_path_factory.mktemp("publish")
    generate_windows(root / "data", SyntheticConfig(windows=2, rows_per_window=512, files_per_window=1))
    run = AnchorRun(root=str(root), name=RUN_ID, model=MODEL, schema=SCHEMA, windows=(TRAIN_WINDOW,),
                    batch_size=BATCH, world_size=WORLD, steps=STEPS)
    mp.spawn(train_and_anchor, args=(run, _keep_held_out_predictions), nprocs=WORLD, join=True)
    return run.anchor_dir()


def _config(anchor: Path, out: Path, **kw):
    from ettflow.publish import PublishConfig

    return PublishConfig(anchor=anchor, output_root=out, data_root=anchor.parent.parent / "data",
                         batch_size=128, validation_batches=4, **kw)


@pytest.fixture(scope="module")
def published(anchor, tmp_path_factory):
    from ettflow.publish import publish_snapshot

    out = tmp_path_factory.mktemp("snapshots")
    return out, publish_snapshot(_config(anchor, out))


# The snapshot as an inference server would call it: no ettflow, no torchrec importable.
SERVE = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('ettflow', 'torchrec'):
            raise ImportError(name)
sys.meta_path.insert(0, Block())
import torch, fbgemm_gpu
m = torch.jit.load(sys.argv[1])
B, n_sparse = 5, int(sys.argv[2])
p = m(torch.rand(B, 13), torch.randint(0, 64, (B * n_sparse,)), torch.ones(B * n_sparse, dtype=torch.int32))
assert p.shape == (B,) and bool(((p > 0) & (p < 1)).all()), p
print('served', [k for k in sys.modules if k.split('.')[0] in ('ettflow', 'torchrec')])
"""


def test_snapshot_is_validated_loads_without_training_code_and_matches_its_manifest(anchor, published):
    from ettflow.publish import verify_snapshot

    out, manifest = published
    folder = out / RUN_ID
    assert Path(manifest.path) == folder and sorted(p.name for p in out.iterdir()) == [RUN_ID]
    assert sorted(p.name for p in folder.iterdir()) == ["manifest.json", "model.pt"]
    assert verify_snapshot(folder).files == manifest.files
    on_disk = json.loads((folder / "manifest.json").read_text())
    assert on_disk["files"]["model.pt"]["size"] == (folder / "model.pt").stat().st_size
    m = manifest.metrics
    assert m["n_examples"] == 512 and m["max_abs_diff"] <= manifest.validation["tolerance"] == 0.02
    assert 0.0 <= m["auc_float"] <= 1.0 and abs(m["auc_snapshot"] - m["auc_float"]) < 0.02
    assert manifest.quantization["enabled"] and manifest.validation["loaded_without"] == ["ettflow", "torchrec"]
    assert manifest.source["world_size"] == WORLD and manifest.step == STEPS
    assert manifest.source["manifest_sha256"] == (anchor / "COMMITTED").read_text().strip()
    assert manifest.data["windows"] == [HELD_OUT] and manifest.schema == SCHEMA.to_dict()
    assert set(manifest.timings_s) >= {"load", "quantize", "script", "validate", "total"}
    served = subprocess.run([sys.executable, "-I", "-c", SERVE, str(folder / "model.pt"), str(len(SCHEMA.sparse))],
                            capture_output=True, text=True, timeout=120, cwd=out)
    assert served.returncode == 0, served.stderr[-2000:]
    assert "served []" in served.stdout


def test_one_process_load_reshards_to_the_trained_model(anchor):
    from ettflow.publish.anchor import load_float_model, open_anchor
    from ettflow.publish.snapshot import SnapshotModule

    trained = torch.load(anchor.parent.parent / "trained_probs.pt")
    dlrm = load_float_model(open_anchor(anchor))
    with torch.no_grad():
        probs = SnapshotModule(dlrm, list(SCHEMA.sparse_names))(trained["dense"], trained["values"],
                                                                 trained["lengths"])
    torch.testing.assert_close(probs, trained["probs"], atol=1e-6, rtol=0)


def test_republishing_replaces_the_snapshot_and_a_failed_one_leaves_it_intact(anchor, published):
    from ettflow.publish import SnapshotValidationError, is_retryable, publish_snapshot, verify_snapshot

    out, first = published
    again = publish_snapshot(_config(anchor, out))
    assert again.path == first.path and again.created_at > first.created_at
    assert again.metrics["max_abs_diff"] == pytest.approx(first.metrics["max_abs_diff"])
    assert verify_snapshot(again.path).created_at == again.created_at
    assert sorted(p.name for p in out.iterdir()) == [RUN_ID]  # no staging or old folders left
    with pytest.raises(SnapshotValidationError, match="tolerance 1e-09") as failed:
        publish_snapshot(_config(anchor, out, tolerance=1e-9))
    assert not is_retryable(failed.value)
    assert sorted(p.name for p in out.iterdir()) == [RUN_ID]
    assert verify_snapshot(out / RUN_ID).created_at == again.created_at


def test_torn_or_unmarked_anchor_is_refused(anchor, tmp_path):
    from ettflow.publish import AnchorError, is_retryable, publish_snapshot

    torn = tmp_path / "checkpoints" / anchor.name
    shutil.copytree(anchor, torn)
    (torn / "COMMITTED").unlink()
    with pytest.raises(AnchorError, match="refusing to publish.*no COMMITTED marker") as err:
        publish_snapshot(_config(torn, tmp_path / "out"))
    assert not is_retryable(err.value) and not (tmp_path / "out").exists()
    shutil.rmtree(torn)
    shutil.copytree(anchor, torn)
    (torn / "anchor.json").unlink()
    with pytest.raises(AnchorError, match="not an anchor"):
        publish_snapshot(_config(torn, tmp_path / "out"))


def test_a_forged_anchor_metadata_is_refused_before_it_is_unpickled(anchor, tmp_path):
    """Someone who can write the anchor's folder replaces its `.metadata` with a pickle that runs
    code and re-seals the manifest (the checksums pass): publishing reads it as a restore does,
    through the restricted reader, so nothing runs and nothing is published."""
    from ettflow.publish import AnchorError, is_retryable, publish_snapshot

    from helpers.forged import forge_metadata

    forged = tmp_path / "checkpoints" / anchor.name
    shutil.copytree(anchor, forged)
    marker = tmp_path / "code-ran"
    forge_metadata(forged, marker)
    with pytest.raises(AnchorError, match=r"refusing to publish: refusing to read .*\.metadata: "
                                          r"(io|builtins)\.open is not a type a DCP metadata file holds") as err:
        publish_snapshot(_config(forged, tmp_path / "out"))
    assert not marker.exists() and not is_retryable(err.value) and not (tmp_path / "out").exists()


def test_cli_reports_a_refused_anchor(anchor, tmp_path, capsys):
    from ettflow.publish import cli

    torn = tmp_path / anchor.name
    shutil.copytree(anchor, torn)
    (torn / "COMMITTED").unlink()
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["publish", "--anchor", str(torn), "--out", str(tmp_path / "out"),
                              "--data", str(anchor.parent.parent / "data")])
    assert args.func(args) == 2
    assert "torn or partial" in capsys.readouterr().err


def test_publish_config_rejects_bad_values(tmp_path):
    from ettflow.publish import PublishConfig

    ok = dict(anchor=tmp_path, output_root=tmp_path, data_root=tmp_path)
    for bad, match in [({"tolerance": 0}, "tolerance"), ({"windows": "w"}, "windows"), ({"windows": []}, "empty"),
                       ({"batch_size": 0}, "batch_size"), ({"run_id": "../x"}, "run_id")]:
        with pytest.raises(ValueError, match=match):
            PublishConfig(**ok, **bad)


def test_cli_publishes_once_and_says_whether_to_run_again(monkeypatch, tmp_path, capsys):
    """`ettflow publish` tries once (retrying is the Prefect task's job); a failure that may
    pass exits 1 and says to run the command again, a refusal exits 2 without that advice."""
    from ettflow.publish import AnchorError, PublishError, cli, publisher

    calls = []

    def failing(error):
        def publish_snapshot(config):
            calls.append(config)
            raise error

        return publish_snapshot

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["publish", "--anchor", str(tmp_path), "--out", str(tmp_path / "out"),
                              "--data", str(tmp_path)])
    monkeypatch.setattr(publisher, "publish_snapshot", failing(PublishError("scoring subprocess crashed")))
    assert args.func(args) == 1 and len(calls) == 1
    err = capsys.readouterr().err
    assert "scoring subprocess crashed" in err and "run the same command again" in err
    monkeypatch.setattr(publisher, "publish_snapshot", failing(AnchorError("torn")))
    assert args.func(args) == 2 and len(calls) == 2
    assert "run the same command again" not in capsys.readouterr().err


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_a_killed_scoring_process_is_a_retryable_publish_failure(tmp_path, monkeypatch, how):
    """The fresh process that loads and scores the snapshot, killed (the OOM killer, an operator):
    not the snapshot's fault, so the publish task's retry may pass (a validation that ran and
    failed stays not retryable: above)."""
    from ettflow.publish import PublishError, SnapshotValidationError, is_retryable, validate

    script = tmp_path / "loadcheck.py"
    script.write_text(f"import os, signal\nos.kill(os.getpid(), signal.{how})\n")
    monkeypatch.setattr(validate, "LOADCHECK", script)
    with pytest.raises(PublishError, match=rf"was killed by signal \d+ \({how}\)") as killed:
        nothing = validate.HeldOut(windows=(), batches=[], labels=torch.zeros(0))
        validate.score_in_fresh_process(tmp_path / "model.pt", nothing)
    assert is_retryable(killed.value) and not isinstance(killed.value, SnapshotValidationError)


def test_a_scoring_process_that_crashes_by_itself_is_a_validation_failure(tmp_path, monkeypatch):
    """SIGSEGV, SIGABRT: the snapshot crashed the interpreter, the same way next time: not retried."""
    from ettflow.publish import SnapshotValidationError, is_retryable, validate

    script = tmp_path / "loadcheck.py"
    script.write_text("import os, signal, sys\nprint('crashing', file=sys.stderr, flush=True)\n"
                      "os.kill(os.getpid(), signal.SIGABRT)\n")
    monkeypatch.setattr(validate, "LOADCHECK", script)
    with pytest.raises(SnapshotValidationError, match=r"(?s)exit -6.*crashing") as crashed:
        validate.score_in_fresh_process(tmp_path / "model.pt", validate.HeldOut(windows=(), batches=[],
                                                                               labels=torch.zeros(0)))
    assert not is_retryable(crashed.value)
