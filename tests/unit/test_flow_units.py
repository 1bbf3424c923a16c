"""The refresh flow's parts without Prefect or Ray: parameters, the lease, the spool notes,
the archiving hooks on a run without a spool, the timeline picture, the CLI's parameters,
retention. (Archiving to a real warehouse: tests/integration/test_flow_archiving.py.)"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from ettflow.ett.sample import write_sample_run
from ettflow.ett.spool import SpoolWriter, read_spool
from ettflow.ett.warehouse import Warehouse
from ettflow.tasks import archive
from ettflow.tasks.lease import TrainerLease
from ettflow.tasks.parameters import RefreshParameters
from ettflow.tasks.plan import ParameterError, parse_failures, plan_refresh, slug
from ettflow.tasks.run_spool import RunRecorder
from ettflow.tasks.timeline_plot import render_timeline
from ettflow.trainer.protocol import PollStatus

from helpers.plans import params


def test_plan_builds_the_trainer_config(flow_data, tmp_path):
    plan = plan_refresh(params(flow_data, tmp_path, fail_at=["kill:rank=1:step=30", "publish:times=2"]),
                        run_id="r1", submitted_at=5.0, artifact_slug="Refresh Adhoc")
    t = plan.trainer
    assert t.work_dir == str(tmp_path / "work" / "dlrm" / "runs" / "r1")
    assert t.compile_cache_dir == tmp_path / "work" / "dlrm" / "compile-cache"
    assert {f.num_embeddings for f in t.schema.sparse} == {100}
    assert len(t.failures) == 1 and t.failures[0].step == 30 and plan.publish_faults.times == 2
    assert plan.artifact_slug == "refresh-adhoc" and not plan.publish_in_trainer and plan.mode == "optimized"


def resolve_switches(mode, switches):
    return RefreshParameters.parse(mode=mode, switches=switches).resolved_switches()


def test_modes_and_single_switches():
    sw, flow = resolve_switches("baseline", None)
    assert flow["publish_in_trainer"] and not flow["delta_snapshot"] and not sw.parallel_init
    assert not sw.async_checkpoint
    sw, flow = resolve_switches("optimized", {"publish_in_trainer": True, "fast_batch": False})
    assert flow["publish_in_trainer"] and not sw.fast_batch and sw.parallel_init and sw.delta_checkpoint
    assert not resolve_switches("baseline", None)[0].delta_checkpoint  # the untuned job saves whole
    sw, flow = resolve_switches("optimized", {"delta_snapshot": True, "delta_checkpoint": False})
    assert flow["delta_snapshot"] and not flow["publish_in_trainer"] and not sw.delta_checkpoint
    # a switch set in its section's own spelling, or by its flat name, is the same switch
    assert resolve_switches("baseline", {"compile_cache": True})[0].compile_cache
    assert RefreshParameters.parse({"mode": "baseline", "switches.compile_cache": True}).resolved_switches()[0] \
        == RefreshParameters.parse({"mode": "baseline", "compile_cache": True}).resolved_switches()[0]


@pytest.mark.parametrize(
    ("over", "name", "text"),
    [
        ({"world_size": 0}, "world_size", ">= 1"),
        ({"mode": "fast"}, "mode", "baseline or optimized"),
        ({"switches": {"warp": True}}, "switches", "unknown switch 'warp'"),
        ({"switches": {"compile": "yes"}}, "switches", "true or false"),
        ({"fail_at": ["explode:step=3"]}, "fail_at", "explode"),
        ({"fail_at": ["kill:rank=2:step=3"]}, "fail_at", "world_size is 2"),
        ({"fail_at": ["publish:when=3"]}, "fail_at", "when"),
        ({"windows": ["window=1999010100"]}, "windows", "not in the data"),
        ({"architecture": {"embedding_dim": 8}}, "architecture", "dense_arch"),
        ({"batch_size": True}, "batch_size", "int"),
        ({"model": "My Model"}, "model", "lowercase"),
        ({"device": "tpu"}, "device", "auto, cpu or cuda"),
        ({"min_world_size": 3}, "min_world_size", "<= world_size"),
        ({"placement_strategy": "RING"}, "placement_strategy", "PACK, SPREAD or STRICT_SPREAD"),
        ({"capacity_wait_s": 0}, "capacity_wait_s", "> 0"),
        ({"training.world_size": -1}, "world_size", ">= 1"),
        ({"training": {"batch_size": 0}}, "batch_size", ">= 1"),
        ({"windows": []}, "windows", "empty"),
    ],
)
def test_a_bad_parameter_is_named(flow_data, tmp_path, over, name, text):
    with pytest.raises(ParameterError, match=rf"parameter '{name}' .*{text}") as info:
        plan_refresh(params(flow_data, tmp_path, **over), run_id="r1")
    assert info.value.parameter == name


def test_missing_data_root_is_named(tmp_path):
    with pytest.raises(ParameterError, match="parameter 'data_root'"):
        plan_refresh(params(tmp_path / "nowhere", tmp_path), run_id="r1")


def test_failure_specs():
    faults, publish = parse_failures(["hang:step=5", "publish", "publish:times=2"])
    assert faults[0].kind == "hang" and (publish.times, publish.slow_s) == (3, 0.0)
    _, slow = parse_failures(["publish:slow_s=30"])  # slow only: no try fails
    assert (slow.times, slow.slow_s) == (0, 30.0)
    with pytest.raises(ParameterError, match="publish takes times=N, slow_s=T"):
        parse_failures(["publish:delay=3"])
    assert slug("Refresh_Model v2") == "refresh-model-v2"


class FakeGroup:
    def __init__(self, log, attempt):
        self.log, self.attempt = log, attempt

    def reserve(self):
        self.log.append(("reserve", self.attempt))

    def launch(self):
        pass

    def poll(self, timeout_s):
        return PollStatus(finished={0: {}, 1: {}})

    def kill(self, rank):
        pass

    def teardown(self):
        self.log.append(("teardown", self.attempt))


def test_lease_holds_a_trained_group_until_release(tmp_path):
    log = []
    lease = TrainerLease(run_id="r1", spool_root=tmp_path, world_size=2,
                         make_group=lambda a: FakeGroup(log, a), first_attempt=3)
    lease.reserve()
    assert lease.has_reserved and log == [("reserve", 3)]
    failed = lease.group_for(3)  # the reserved group: reserving again is a no-op
    failed.reserve()
    failed.teardown()  # a failed attempt (no rank finished) is torn down at once
    assert log == [("reserve", 3), ("teardown", 3)] and not lease.has_reserved
    done = lease.group_for(4)
    done.reserve()
    done.poll(0)
    done.teardown()  # trained: the devices stay held
    assert log[-1] == ("reserve", 4) and lease.holding is done
    held = lease.release()
    assert log[-1] == ("teardown", 4) and held >= 0 and lease.release() == 0.0
    (shutdown,) = read_spool(tmp_path, "r1").events
    assert (shutdown.phase, shutdown.attempt, shutdown.rank) == ("shutdown", 4, -1)


def test_a_lease_that_publishes_on_the_cpu_releases_a_trained_group_at_the_drivers_teardown(tmp_path):
    """Nothing after training needs the devices (the anchor sealed from host memory, publishing
    on the CPU): the trained group is torn down when the driver says so, its release time is
    the driver's (its `shutdown` ends there), and the lease's release holds nothing more."""
    log = []

    class Releasing(FakeGroup):
        released_at = None

        def teardown(self):
            super().teardown()
            self.released_at = 123.0

    lease = TrainerLease(run_id="r1", spool_root=tmp_path, world_size=2,
                         make_group=lambda a: Releasing(log, a), first_attempt=0, hold_after_training=False)
    lease.reserve()
    done = lease.group_for(0)
    done.poll(0)
    assert done.released_at is None  # not released yet
    done.teardown()
    assert log == [("reserve", 0), ("teardown", 0)] and lease.holding is None and done.released_at == 123.0
    assert lease.release() == 0.0 and log[-1] == ("teardown", 0)
    assert not (tmp_path / "r1").exists()  # no device-held time recorded after the driver's release


def test_task_failures_are_marked_once(tmp_path):
    assert RunRecorder(tmp_path, "r1").next_attempt() == 0
    with SpoolWriter(tmp_path, "r1", 0, -1) as rec:
        rec.mark("failure_detected", 10.0, failure_class="infrastructure", reason="rank 1 died")
    assert not RunRecorder(tmp_path, "r1").record_task_failure(0, RuntimeError("x"), task="train", at=11.0)
    assert RunRecorder(tmp_path, "r1").record_task_failure(1, ValueError("bad"), task="train", at=12.0)
    marks = [e for e in read_spool(tmp_path, "r1").events if e.attempt == 1]
    assert marks[0].attrs["failure_class"] == "user" and marks[0].attrs["task_retry"]
    assert RunRecorder(tmp_path, "r1").next_attempt() == 2


def test_a_stop_an_operator_asked_for_is_marked_as_theirs_not_a_failure(tmp_path):
    """Issue 42 #6: a task that sees its process stopped asks who stopped it: a cancel is an
    `operator_stop` marker and no failure; an answer it cannot get leaves it a preemption."""
    from ettflow.trainer.group.stop_request import StopRequested

    rec = RunRecorder(tmp_path, "r1")
    cancel = "cancelled by an operator (Prefect state Cancelling)"
    assert rec.record_task_failure(0, StopRequested(15), task="train", at=5.0, stop_cause=lambda: cancel) is None
    (stop,) = [e for e in read_spool(tmp_path, "r1").events if e.attempt == 0]
    assert (stop.phase, stop.start, stop.attrs["reason"]) == ("operator_stop", 5.0, f"{cancel} (SIGTERM)")
    assert rec.failures() == [] and rec.next_attempt() == 1
    # an error is a failure whoever is asked; a stop nobody can explain is a preemption
    assert rec.record_task_failure(1, ValueError("bad"), task="train", at=6.0, stop_cause=lambda: cancel)

    def no_api() -> str | None:
        raise OSError("no Prefect API")

    failure = rec.record_task_failure(2, StopRequested(15), task="train", at=7.0, stop_cause=no_api)
    assert failure is not None and failure.failure_class.value == "preemption"
    assert [f.attempt for f in rec.failures()] == [1, 2]


@pytest.mark.parametrize("state", ["FAILED", "CRASHED"])
def test_hooks_skip_a_run_without_spool(tmp_path, monkeypatch, caplog, state):
    """A hook never raises for a run that spooled nothing, and writes nothing: no warehouse
    (neither the one ETTFLOW_WAREHOUSE_URL names nor the default under ETTFLOW_HOME), no spool
    folder for the run, no pending mark. Failed so: refused (a parameter, before anything ran),
    whose one line is its state's (issue 42 #8); crashed so: the log says there was nothing to
    archive."""
    monkeypatch.setenv("ETTFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("ETTFLOW_WAREHOUSE_URL", f"sqlite:///{tmp_path / 'warehouse.db'}")
    spool = tmp_path / "spool"
    spool.mkdir()
    flow_run = SimpleNamespace(id="0f0f", parameters={"spool_root": str(spool)}, deployment_id=None,
                               run_count=1)
    with caplog.at_level(logging.WARNING, logger="ettflow.tasks"):
        archive.archive_on_flow_state(SimpleNamespace(name="refresh-model"), flow_run,
                                      SimpleNamespace(type=SimpleNamespace(value=state)))
    said = f"run 0f0f has no spooled events under {spool}: nothing to archive" in caplog.text
    assert said == (state == "CRASHED"), caplog.text
    assert [p.name for p in tmp_path.iterdir()] == ["spool"] and list(spool.iterdir()) == []


def test_timeline_picture(tmp_path):
    from ettflow.ett.run_metrics import compute_run_metrics

    write_sample_run(tmp_path, "run-b", seed=2)
    events = read_spool(tmp_path, "run-b").events
    png = render_timeline(events, compute_run_metrics(events))
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_the_timeline_axis_is_the_runs_wall_and_a_long_cpu_publish_is_said_in_words():
    """Issue 43: a 110-s publish after the release set the axis of a 23.7-s run."""
    from ettflow.ett.run_metrics import compute_run_metrics
    from ettflow.tasks.timeline_plot import axis_end, publish_note

    from helpers.timelines import Timeline

    t = Timeline("pub").mark("submitted", 100).ev("scheduling", 100, 102, rank=-1).steps(102, 0, 20)
    t.ev("shutdown", 122, 123.7, rank=-1).ev("publish_standalone", 124.0, 234.0, rank=-1, outcome="published")
    m = compute_run_metrics(t.events)
    assert m.wall_s == pytest.approx(23.7) and axis_end(m) == pytest.approx(23.7 * 1.01)
    publish = [e for e in t.events if e.phase == "publish_standalone"]
    assert publish_note(publish, m.wall_start, axis_end(m)) == \
        "publish on the CPU, off the clock: 24.0-134.0 s (110.0 s) →"
    assert publish_note([], m.wall_start, axis_end(m)) == ""
    png = render_timeline(t.events, m)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    # the picture's page says why Prefect's duration of the run is longer than this wall
    from ettflow.tasks.artifacts import WALL_NOTE, timeline_markdown

    text = timeline_markdown("pub", png, m)
    assert "of 23.7 s wall" in text and WALL_NOTE in text and "publishing the snapshot" in WALL_NOTE


def test_cli_parameters():
    import argparse

    from ettflow.flows import cli

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["refresh", "--mode", "baseline", "--switch", "fast_batch=true",
                              "--param", "max_embeddings=500", "--world-size", "2"])
    p = cli.parameters(args)
    assert p["mode"] == "baseline" and p["switches"] == {"fast_batch": True}
    assert p["max_embeddings"] == 500 and p["fail_at"] == [cli.DEMO_FAILURE] and p["world_size"] == 2
    assert cli.parameters(parser.parse_args(["refresh", "--no-failure"]))["fail_at"] == []


def test_the_flow_the_form_the_cli_and_the_bench_take_the_same_parameters():
    """One model (`RefreshParameters`): the flow's signature is its fields with its defaults;
    the run form's schema has every leaf with its description and limits; the CLI's help names
    every leaf and every switch; the bench's rows accept every switch; an unknown name is
    refused by name, in any spelling."""
    import argparse
    import inspect

    from prefect.utilities.callables import parameter_schema

    from ettflow.bench.jobs import Row
    from ettflow.flows import cli
    from ettflow.flows.refresh import refresh_model
    from ettflow.tasks.parameters import SwitchParams

    signature = inspect.signature(refresh_model.fn).parameters
    defaults = RefreshParameters()
    assert list(signature) == list(RefreshParameters.model_fields)
    assert {n: p.default for n, p in signature.items()} == {n: getattr(defaults, n) for n in signature}

    schema = parameter_schema(refresh_model).model_dump()
    for name in RefreshParameters.model_fields:  # each top-level parameter (a section: a group) is described
        prop = schema["properties"][name]  # a section's own description is its definition's (pydantic drops a copy)
        ref = prop.get("$ref", "").rpartition("/")[2]
        assert prop.get("description") or schema["definitions"][ref]["description"], name
    leaves = {leaf: (section, schema["definitions"][RefreshParameters.sections()[section].__name__])
              for leaf, section in RefreshParameters.LEAVES.items()}
    for leaf, (section, definition) in leaves.items():
        assert definition["properties"][leaf].get("description"), f"{section}.{leaf}"
    training = schema["definitions"]["TrainingParams"]["properties"]
    assert training["world_size"]["minimum"] == 1 and training["world_size"]["type"] == "integer"
    for switch in schema["definitions"]["SwitchParams"]["properties"].values():  # "preset" or an on/off toggle
        assert switch["anyOf"] == [{"type": "null", "title": "preset"}, {"type": "boolean", "title": "on/off"}]
        assert switch["default"] is None
    assert schema["properties"]["model"]["pattern"] and schema["properties"]["mode"]["enum"] == ["baseline",
                                                                                                 "optimized"]

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    helps = {a.dest: a.help for a in parser._subparsers._group_actions[0].choices["refresh"]._actions}
    assert all(leaf in helps["param"] for leaf in RefreshParameters.LEAVES)
    assert all(switch in helps["switch"] for switch in SwitchParams.model_fields)
    for switch in SwitchParams.model_fields:
        Row(label=switch, mode="optimized", switches={switch: False})

    for spelling in ({"colour": "red"}, {"training.colour": 1}, {"training": {"colour": 1}}):
        with pytest.raises(ParameterError, match="colour"):
            RefreshParameters.parse(spelling)
    with pytest.raises(ParameterError, match="parameter 'colour' is not a parameter") as info:
        RefreshParameters.parse({"colour": "red"})
    assert info.value.parameter == "colour"


def test_every_spelling_of_a_parameter_is_the_same_parameter():
    """Flat names (earlier releases), dotted names and nested sections build one model;
    `to_json` (a deployment run's parameters) parses back to it."""
    flat = RefreshParameters.parse({"world_size": 3, "compile": False, "fail_at": ["kill:rank=2:step=4"],
                                    "architecture": {"embedding_dim": 8, "dense_arch": [8], "over_arch": [4, 1]}})
    dotted = RefreshParameters.parse({"training.world_size": 3, "switches.compile": False,
                                      "faults.fail_at": ["kill:rank=2:step=4"], "architecture.embedding_dim": 8,
                                      "architecture.dense_arch": [8], "architecture.over_arch": [4, 1]})
    nested = RefreshParameters.parse({"training": {"world_size": 3}, "switches": {"compile": False},
                                      "faults": {"fail_at": ["kill:rank=2:step=4"]},
                                      "architecture": {"embedding_dim": 8, "dense_arch": [8], "over_arch": [4, 1]}})
    assert flat == dotted == nested == RefreshParameters.parse(flat.to_json()) == RefreshParameters.parse(flat)
    assert flat.to_json() == {"architecture": {"embedding_dim": 8, "dense_arch": [8], "over_arch": [4, 1]},
                              "training": {"world_size": 3}, "switches": {"compile": False},
                              "faults": {"fail_at": ["kill:rank=2:step=4"]}}
    assert RefreshParameters.parse(flat, world_size=4).training.world_size == 4  # `over` on top


def test_a_refused_run_s_parameters_are_read_as_far_as_they_are_valid():
    """A hook reads the parameters of a run Prefect refused: the spool, the warehouse and the
    names survive a bad value elsewhere (that section falls back to its defaults)."""
    raw = {"model": "m", "training": {"world_size": 0, "batch_size": 4}, "storage": {"spool_root": "/s"},
           "warehouse": {"warehouse_url": "sqlite:////tmp/w.db"}, "nosuch": 1}
    p = RefreshParameters.lenient(raw)
    assert (p.model, p.storage.spool_root, p.warehouse.warehouse_url) == ("m", "/s", "sqlite:////tmp/w.db")
    assert (p.training.world_size, p.training.batch_size) == (2, 4)
    assert RefreshParameters.lenient(None) == RefreshParameters()


SECRET = "s3cret-pw"
PASSWORD_URL = f"postgresql+psycopg://postgres:{SECRET}@127.0.0.1:5999/x"


def test_a_warehouse_url_with_a_password_is_refused(flow_data, tmp_path):
    with pytest.raises(ParameterError, match="parameter 'warehouse_url' holds a password") as info:
        plan_refresh(params(flow_data, tmp_path, warehouse_url=PASSWORD_URL), run_id="r1")
    assert "ETTFLOW_WAREHOUSE_URL" in str(info.value) and "warehouse_secret" in str(info.value)
    assert SECRET not in str(info.value)
    plan = plan_refresh(params(flow_data, tmp_path, warehouse_url="postgresql+psycopg://postgres@h/x",
                               warehouse_secret="team-warehouse"), run_id="r1")
    assert plan.warehouse.model_dump() == {"warehouse_url": "postgresql+psycopg://postgres@h/x",
                                           "warehouse_secret": "team-warehouse"}


def test_redact_url():
    from ettflow.ett.redact import has_password, redact_url

    assert redact_url(PASSWORD_URL) == "postgresql+psycopg://postgres:***@127.0.0.1:5999/x"
    assert redact_url("sqlite:////tmp/w.db") == "sqlite:////tmp/w.db"
    assert redact_url(f"no scheme //u:{SECRET}@host") == "no scheme //u:***@host"
    assert has_password(PASSWORD_URL) and not has_password("postgresql://u@h/db")


# a secret anywhere SQLAlchemy or the driver takes one: the userinfo (a password runs to the first
# '@', '/' included), the query (psycopg and libpq read `password` there), a URL that does not parse
SLASHED = f"{SECRET}/x"  # a password with a '/' in it
SECRET_URLS = [  # (url, its secret, as shown)
    (f"postgresql+psycopg://etl@db.example/x?password={SECRET}&sslmode=require", SECRET,
     "postgresql+psycopg://etl@db.example/x?password=***&sslmode=require"),
    (f"postgresql+psycopg://etl:{SLASHED}@db/x", SLASHED, "postgresql+psycopg://etl:***@db/x"),
    (f"postgresql+psycopg://etl@db/x?sslmode=verify-full&sslpassword={SECRET}", SECRET,
     "postgresql+psycopg://etl@db/x?sslmode=verify-full&sslpassword=***"),
    (f"no scheme //u:{SLASHED}@host/db", SLASHED, "no scheme //u:***@host/db"),
    (f"no scheme //u@host/db?sslmode=x&Password={SECRET}#f", SECRET, "no scheme //u@host/db?sslmode=x&Password=***#f"),
]
PLAIN_URLS = ("postgresql://u@h/db?sslmode=require&passfile=/home/u/.pgpass", "sqlite:////tmp/w.db",
              "postgresql+psycopg://postgres@127.0.0.1:5999/x")


def test_a_secret_in_a_urls_query_or_after_a_slash_is_found_hidden_and_refused(flow_data, tmp_path):
    import re
    from urllib.parse import quote

    from ettflow.ett.archive import outage_reason
    from ettflow.ett.redact import SECRET_URL_PATTERN, has_password, redact_argv, redact_url, scrub

    for url, secret, shown in SECRET_URLS:
        assert has_password(url) and redact_url(url) == shown, url
        said = f"connect failed: password {secret}, encoded {quote(secret, safe='')}"
        assert scrub(said, url) == "connect failed: password ***, encoded ***", url
        assert outage_reason(OSError(said), url) == "OSError: connect failed: password ***, encoded ***", url
        # the command line a bench report writes (`bench.output.command_line`)
        argv = ["bench", "--url", url, f"--url={url}", "--quick"] if "://" in url else []
        assert redact_argv(argv) == ["bench", "--url", shown, f"--url={shown}", "--quick"][:len(argv)], url
        assert re.search(SECRET_URL_PATTERN, url), url  # the server's pattern, in any case
        with pytest.raises(ParameterError, match="holds a password") as info:
            plan_refresh(params(flow_data, tmp_path, warehouse_url=url), run_id="r1")
        assert SECRET not in str(info.value)
    for url in PLAIN_URLS:
        assert not has_password(url) and "***" not in redact_url(url) and not re.search(SECRET_URL_PATTERN, url), url


def test_resolve_warehouse_url_without_a_secret(monkeypatch):
    from ettflow.tasks.warehouse_url import resolve_warehouse_url, warehouse_source

    monkeypatch.delenv("ETTFLOW_WAREHOUSE_URL", raising=False)
    assert resolve_warehouse_url({}) is None
    assert resolve_warehouse_url({"warehouse_url": "sqlite:////tmp/w.db"}) == "sqlite:////tmp/w.db"
    assert warehouse_source({"warehouse_url": "sqlite:////tmp/w.db"}) == "the warehouse_url parameter"
    with pytest.raises(ParameterError, match="parameter 'warehouse_url' holds a password") as info:
        resolve_warehouse_url({"warehouse_url": PASSWORD_URL})
    assert SECRET not in str(info.value)


def test_an_unreachable_warehouse_is_named_redacted(monkeypatch):
    from ettflow.tasks.warehouse_url import WarehouseUnavailable, open_check

    monkeypatch.setenv("ETTFLOW_WAREHOUSE_URL", PASSWORD_URL)
    with pytest.raises(WarehouseUnavailable) as info:
        open_check({})
    text = str(info.value)
    assert text.startswith("warehouse postgresql+psycopg://postgres:***@127.0.0.1:5999/x is unreachable: ")
    assert text.endswith("fix ETTFLOW_WAREHOUSE_URL") and SECRET not in text and "\n" not in text


def test_errors_logged_beside_the_warehouse_hide_its_password(monkeypatch, tmp_path, caplog):
    """Log sites that print an error from the warehouse's side (a reconciliation that failed, a
    dead holder not archived, a lineage kept in the spool, the pool's ledger) hide every secret
    of the URL the run resolves (here the environment's), should a driver's message quote it."""
    from ettflow.ett.archive import outage_reason
    from ettflow.tasks import reconcile
    from ettflow.tasks.warehouse_url import error_text

    monkeypatch.setenv("ETTFLOW_WAREHOUSE_URL", PASSWORD_URL)
    quoted = RuntimeError(f"could not parse {PASSWORD_URL}")
    assert error_text(quoted, {}) == "RuntimeError: could not parse postgresql+psycopg://postgres:***@127.0.0.1:5999/x"
    # another URL than the run's (or none resolved): any URL's secret in the text is hidden too
    other = RuntimeError("postgresql://u:pw/x@h/db?sslpassword=key&x=1 failed; postgresql://h:5432/db: role u@h")
    assert outage_reason(other) == ("RuntimeError: postgresql://u:***@h/db?sslpassword=***&x=1 failed; "
                                    "postgresql://h:5432/db: role u@h")

    def fails(*args, **kwargs):
        raise quoted

    monkeypatch.setattr(reconcile, "settle_pending_lineage", fails)
    with caplog.at_level(logging.WARNING, logger="ettflow"):
        assert reconcile.reconcile_before_refresh(tmp_path, None, "r1") == []
    (said,) = [r.getMessage() for r in caplog.records if "reconciliation of" in r.getMessage()]
    assert "Traceback" in said and "postgres:***@" in said and SECRET not in said


def test_cli_never_passes_or_prints_a_password():
    import argparse

    from ettflow.flows import cli

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    for argv in (["--warehouse-url", PASSWORD_URL], ["--param", f"warehouse_url={PASSWORD_URL}"]):
        args = parser.parse_args(["refresh", *argv])
        assert "warehouse_url" not in cli.parameters(args) and cli.private_warehouse_url(args) == PASSWORD_URL
    plain = parser.parse_args(["refresh", "--warehouse-url", "sqlite:////tmp/w.db"])
    assert cli.parameters(plain)["warehouse_url"] == "sqlite:////tmp/w.db" and cli.private_warehouse_url(plain) is None


def test_retention_keeps_the_last_refreshes_the_current_and_the_parent():
    from ettflow.ett.lineage import LineageRecord, Outcome
    from ettflow.tasks.retention import doomed_runs

    def rec(run, t, outcome=Outcome.PUBLISHED, anchor=True):
        return LineageRecord(model="m", run_id=run, windows=("w",), outcome=outcome, created_at=t, finished_at=t + 1,
                             anchor=f"/{run}" if anchor else None)

    refreshes = [rec("r1", 1), rec("r2", 2), rec("r3", 3, Outcome.GATED), rec("r4", 4, Outcome.FAILED),
                 rec("r5", 5, Outcome.SKIPPED, anchor=False), rec("r0", 0)]
    folders = {"r0": True, "r1": True, "r2": True, "r3": True, "r4": True, "old": True, "training": False, "now": False}
    # keep 2: r4, r3 (newest with anchors); r2 is current (last published); r0 the parent; no-anchor folders stay
    assert doomed_runs(folders, refreshes, keep=2, protected={"now", "r0"}) == ["old", "r1"]
    assert doomed_runs(folders, refreshes, keep=10, protected=set()) == ["old"]
    assert doomed_runs(folders, [], keep=1, protected={"r1"}) == ["old", "r0", "r2", "r3", "r4"]


def test_retention_keeps_the_folder_a_reused_anchor_lives_in(tmp_path):
    """A refresh that published the anchor a stopped run sealed (`anchor_reuse`) has no folder of
    its own: its anchor lives in the stopped run's. That folder is its, while it is current or a
    parent or among the last refreshes; the next refresh warm-starts from it."""
    from pathlib import Path

    from ettflow.ett.lineage import LineageRecord, Outcome
    from ettflow.tasks.retention import anchor_home, doomed_runs

    runs = tmp_path / "runs"

    def rec(run, t, outcome, home):
        return LineageRecord(model="m", run_id=run, windows=("w",), outcome=outcome, created_at=t, finished_at=t + 1,
                             anchor=str(runs / home / "checkpoints" / "step_24"))

    stopped, reused = rec("a", 1, Outcome.FAILED, "a"), rec("b", 2, Outcome.PUBLISHED, "a")
    refreshes = [rec("p", 0, Outcome.PUBLISHED, "p"), stopped, reused, rec("c", 3, Outcome.GATED, "c"),
                 rec("d", 4, Outcome.GATED, "d")]
    folders = {"p": True, "a": True, "c": True, "d": True}
    # d's prune, keep 1: d itself; b is current and d's parent, its anchor in a's folder
    assert doomed_runs(folders, refreshes, keep=1, protected={"d", "b"}, runs_root=runs) == ["c", "p"]
    assert anchor_home(reused.anchor, runs) == "a" and anchor_home("/elsewhere/x", runs) is None
    # another host that mounts the shared work root elsewhere wrote the same tail
    assert anchor_home(str(Path("/mnt/other", *runs.parts[-2:], "a", "checkpoints", "step_24")), runs) == "a"
    # the parent alone names the folder (it is no longer current: a later refresh published)
    later = [*refreshes, rec("e", 5, Outcome.PUBLISHED, "e")]
    doomed = doomed_runs({**folders, "e": True}, later, keep=1, protected={"e", "b", "a"}, runs_root=runs)
    assert doomed == ["c", "d", "p"]


def test_prune_task_removes_only_doomed_folders(tmp_path, flow_data, monkeypatch):
    from ettflow.ett.lineage import LineageRecord, Outcome
    from ettflow.tasks.retention import apply_retention

    url = f"sqlite:///{tmp_path / 'w.db'}"
    plan = plan_refresh(params(flow_data, tmp_path, warehouse_url=url, keep_refreshes=1), run_id="now")
    for run in ("a", "b", "c"):
        (plan.runs_root / run / "checkpoints" / "1").mkdir(parents=True)
        (plan.runs_root / run / "checkpoints" / "1" / "anchor.json").write_text("{}")
    with Warehouse.open(url) as wh:
        for t, run in enumerate(("a", "b", "c")):
            wh.record_lineage(LineageRecord(model="dlrm", run_id=run, windows=("w",), anchor=f"/{run}",
                                            outcome=Outcome.PUBLISHED if run != "c" else Outcome.GATED,
                                            created_at=t, finished_at=t))
    assert apply_retention(plan) == (["a"], 2)  # c: the last refresh; b: the current anchor
    assert sorted(p.name for p in plan.runs_root.iterdir()) == ["b", "c"]


def test_prune_removes_the_checkpoints_of_a_run_that_is_over_a_day_after_they_last_changed(tmp_path, flow_data):
    """A failed or killed refresh leaves checkpoints without an anchor, which nothing reads once its
    run is over; they went nowhere, a model's size each. Removed when the run's heartbeat ended or
    went silent (or it has none) and nothing in the folder changed for a day; a run whose heartbeat
    is live, a recent folder and this run are kept."""
    import json
    import os
    import time

    from ettflow.ett.heartbeat import RunHeartbeat, heartbeat_file
    from ettflow.tasks.retention import ABANDONED_AFTER_S, apply_retention

    url = f"sqlite:///{tmp_path / 'w.db'}"
    plan = plan_refresh(params(flow_data, tmp_path, warehouse_url=url, keep_refreshes=1), run_id="now")
    old = time.time() - ABANDONED_AFTER_S - 60
    for run in ("failed-old", "failed-new", "live-old", "silent-old", "now"):
        step = plan.runs_root / run / "checkpoints" / "step_8"
        step.mkdir(parents=True)
        (step / "__0_0.distcp").write_bytes(b"x")
        if run.endswith("-old") or run == "now":
            for p in (step / "__0_0.distcp", step, step.parent, step.parent.parent):
                os.utime(p, (old, old))
    with pytest.raises(ValueError), RunHeartbeat(plan.spool_root, "failed-old"):
        raise ValueError("the refresh failed")
    beat = heartbeat_file(plan.spool_root, "live-old")  # beating now, its folder untouched for a day
    beat.parent.mkdir(parents=True)
    beat.write_text(json.dumps({"run_id": "live-old", "every_s": 2.0, "started_at": old}))
    assert apply_retention(plan) == (["failed-old", "silent-old"], 3)
    assert sorted(p.name for p in plan.runs_root.iterdir()) == ["failed-new", "live-old", "now"]


def test_the_refresh_reconciles_before_it_asks_whether_there_is_new_data():
    """Issue 42 #8: after a warehouse outage the refresh that reconciles asked "is there new
    data?" (the demo's arrival) of the watermark before reconciliation moved it, and skipped
    with "nothing new". The flow's body now reconciles first: checked on its calls' order (the
    claim is in `_claim_and_refresh`, which the body calls after both)."""
    import ast
    import inspect
    import textwrap

    from ettflow.flows import refresh

    def first_calls(fn, names) -> dict[str, int]:
        first: dict[str, int] = {}
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(fn)))):
            if isinstance(node, ast.Call):
                func = node.func.func if isinstance(node.func, ast.Call) else node.func  # reconcile_task()(...)
                name = getattr(func, "id", None)
                if name in names:
                    first[name] = min(first.get(name, node.lineno), node.lineno)
        return first

    body = first_calls(refresh.refresh_model.fn, ("reconcile_task", "arrive_windows", "_claim_and_refresh",
                                                  "claim_windows"))
    assert body["reconcile_task"] < body["arrive_windows"] < body["_claim_and_refresh"], body
    assert "claim_windows" not in body and "claim_windows" in first_calls(refresh._claim_and_refresh,
                                                                          ("claim_windows",))


@pytest.mark.parametrize("in_trainer", [True, False])
def test_a_failed_release_after_a_publish_on_the_devices_leaves_the_run_published(monkeypatch, caplog, in_trainer):
    """`publish_in_trainer` (the baseline's way) publishes before the devices are released: the
    lineage says PUBLISHED and `current` moved. A release that fails then (the spool's disk full
    as it records the shutdown) used to fail the run, recording FAILED over that record, so the
    published windows were trained again. Without a publish, the release's failure is the run's."""
    from ettflow.flows import refresh

    published = []
    monkeypatch.setattr(refresh, "reserve_trainer", lambda plan: "lease")
    monkeypatch.setattr(refresh, "train", lambda plan, lease, fence: "trained")
    monkeypatch.setattr(refresh, "anchor_checkpoint", lambda plan, trained: "/anchor")
    snapshot = SimpleNamespace(outcome=SimpleNamespace(value="published"))
    monkeypatch.setattr(refresh, "publish", lambda plan, anchor, on_devices=False: published.append(on_devices) or
                        snapshot)

    def release(plan, lease):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(refresh, "release_trainer", release)
    monkeypatch.setattr(refresh, "get_run_logger", lambda: logging.getLogger("ettflow.test"))
    plan = SimpleNamespace(publish_in_trainer=in_trainer, run_id="r1")
    progress = SimpleNamespace(show=lambda text: None)
    if in_trainer:
        with caplog.at_level(logging.WARNING, logger="ettflow.test"):
            assert refresh._train_and_publish(plan, progress, None) == ("/anchor", snapshot)
        assert published == [True] and "run r1's trainer failed (OSError" in caplog.text
        assert "its snapshot was published on the devices, which stands" in caplog.text
    else:
        with pytest.raises(OSError, match="No space left"):
            refresh._train_and_publish(plan, progress, None)
        assert published == []  # nothing published: the run fails as before


def test_a_release_that_fails_after_the_training_failed_leaves_the_trainings_error_raised(monkeypatch, caplog):
    """Before, the release's error (raised in a `finally`) replaced the training's: the run's
    recorded reason, and what Prefect's retry decided on, were the release's."""
    from ettflow.flows import refresh

    monkeypatch.setattr(refresh, "reserve_trainer", lambda plan: "lease")

    def train(plan, lease, fence):
        raise RuntimeError("rank 1 died past the restart budget")

    def release(plan, lease):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(refresh, "train", train)
    monkeypatch.setattr(refresh, "release_trainer", release)
    monkeypatch.setattr(refresh, "get_run_logger", lambda: logging.getLogger("ettflow.test"))
    plan = SimpleNamespace(publish_in_trainer=False, run_id="r1")
    with caplog.at_level(logging.WARNING, logger="ettflow.test"), pytest.raises(RuntimeError, match="restart budget"):
        refresh._train_and_publish(plan, SimpleNamespace(show=lambda text: None), None)
    assert "releasing run r1's trainer failed (OSError" in caplog.text and "own error is the one raised" in caplog.text
