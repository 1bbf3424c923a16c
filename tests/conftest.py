import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


# ==============================================================================================
# Warehouse fixtures: each warehouse test runs against a fresh SQLite
# file and against the real local PostgreSQL. PostgreSQL gets a database made for this test
# session (dropped at its end) and a fresh schema per test, so runs never collide. If
# PostgreSQL is unreachable its tests FAIL; ETTFLOW_SKIP_POSTGRES=1 skips them instead.
# ETTFLOW_TEST_POSTGRES_URL names another server (its database part is not used).
# ==============================================================================================
import os  # noqa: E402
import uuid  # noqa: E402

import pytest  # noqa: E402

POSTGRES_TEST_URL = os.environ.get(
    "ETTFLOW_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


def _pg_admin_engine():
    from sqlalchemy import create_engine, make_url

    url = make_url(POSTGRES_TEST_URL).set(database="postgres")
    return create_engine(url, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 5})


@pytest.fixture(scope="session")
def postgres_url():
    """URL of a PostgreSQL database created for this test session, dropped at its end."""
    if os.environ.get("ETTFLOW_SKIP_POSTGRES") == "1":
        pytest.skip("ETTFLOW_SKIP_POSTGRES=1: PostgreSQL tests skipped")
    from sqlalchemy import make_url, text
    from sqlalchemy.exc import DBAPIError

    admin = _pg_admin_engine()
    name = f"ettflow_test_{uuid.uuid4().hex[:12]}"
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except DBAPIError as exc:
        admin.dispose()
        shown = admin.url.render_as_string(hide_password=True)
        pytest.fail(
            f"PostgreSQL at {shown} is unreachable or refused CREATE DATABASE: {exc.orig}\n"
            "Start it (pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start), "
            "point ETTFLOW_TEST_POSTGRES_URL at a server, or set ETTFLOW_SKIP_POSTGRES=1.",
            pytrace=False,
        )
    url = make_url(POSTGRES_TEST_URL).set(database=name)
    yield url.render_as_string(hide_password=False)
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture
def postgres_schema_url(postgres_url):
    """`postgres_url` with a fresh, empty schema first on the search_path (dropped after)."""
    from sqlalchemy import create_engine, make_url, text

    schema = f"t_{uuid.uuid4().hex[:12]}"
    engine = create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    url = make_url(postgres_url).update_query_dict({"options": f"-csearch_path={schema}"})
    yield url.render_as_string(hide_password=False)
    with engine.connect() as conn:
        conn.execute(text("SET lock_timeout = '10s'"))
        conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
    engine.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def warehouse_url(request, tmp_path):
    """A URL of a fresh, empty warehouse database: a SQLite file, then PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'warehouse.db'}"
    return request.getfixturevalue("postgres_schema_url")


# ============================================================================ end warehouse ===


# ==============================================================================================
# One Ray, one Prefect test harness and one compile-cache archive for the session.
# ==============================================================================================
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")  # a cold 2-core machine
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


@pytest.fixture(scope="session")
def ray_session():
    import ray

    from ettflow.trainer.group.ray_group import ensure_ray

    ensure_ray(num_cpus=4)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def prefect_harness():
    """A temporary Prefect API (SQLite) for the session; flows run against it."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


@pytest.fixture(scope="session")
def flow_data(tmp_path_factory):
    """Tiny synthetic windows for flow runs: 2 training windows of 1920 rows give 60 steps of
    2 ranks x 32; the third window is held out (evaluation and snapshot validation)."""
    from ettflow.trainer.data.synthetic import SyntheticConfig, generate_windows

    root = tmp_path_factory.mktemp("flow-data")
    generate_windows(root, SyntheticConfig(windows=3, rows_per_window=1920, files_per_window=2, seed=3))
    return root


@pytest.fixture(scope="session")
def flow_work_root(tmp_path_factory):
    """The work root of every flow run of the session (checkpoints under <model>/runs); the
    model `dlrm`'s compile cache in it is the session's (`compile_cache`)."""
    return tmp_path_factory.mktemp("flow-work")


@pytest.fixture(scope="session")
def compile_cache(flow_work_root, tmp_path_factory, ray_session) -> Path:
    """The session's compile-cache archive of the tiny model (helpers.flows.TINY, batch 32):
    built once by a 2-step run of the real trainer (the session's one cold compile), then
    restored by every run that compiles, flow runs of `dlrm` under `flow_work_root` and
    trainer runs (their `compile_cache_root`) alike."""
    import shutil
    from dataclasses import replace

    from filelock import FileLock

    from ettflow.trainer.compile.process_cache import has_archive
    from ettflow.trainer.data.synthetic import SyntheticConfig, generate_windows

    from helpers.flows import MODEL
    from helpers.trainer_runs import config, drive, session_compile_cache

    root = flow_work_root / MODEL / "compile-cache"
    # under xdist, the first worker builds it, and every worker copies it (each its own: a run
    # that misses writes to it)
    shared = session_compile_cache(tmp_path_factory)
    with FileLock(str(shared) + ".lock"):
        world = shared.with_name("compile-cache-build")
        if not (world / "data").is_dir():
            generate_windows(world / "data",
                             SyntheticConfig(windows=2, rows_per_window=256, files_per_window=1, seed=1))
        cfg = config(world, "build", shared, max_steps=2, eval_batches=0).with_switches(
            live_recovery=False, memory_checkpoint=False)
        if not has_archive(cfg):
            drive(world, cfg, "compile-cache-build")
        assert has_archive(cfg), f"the session's compile-cache archive was not written under {shared}"
        shutil.copytree(shared, root, dirs_exist_ok=True)
    assert has_archive(replace(cfg, compile_cache_root=str(root))), f"the archive was not copied to {root}"
    return root


# ==============================================================================================
# A real Prefect server (the deployed path's e2e tests, and its UI for the browser test):
# `prefect server start` in
# its own PREFECT_HOME, once per session, with the process work pool `PREFECT_POOL` created.
# Yields (env, api): the environment for `prefect` commands and workers
# (no inherited PREFECT_* settings) and the API URL.
# ==============================================================================================
PREFECT_POOL = "ettflow-process"


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    import signal
    import socket
    import subprocess
    import time

    import httpx

    prefect_cli = str(Path(sys.executable).with_name("prefect"))
    home = tmp_path_factory.mktemp("prefect-home")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    api = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(home), PREFECT_API_URL=api, PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_UI_ENABLED="true", PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED="false",
               PREFECT_CLI_PROMPT="false", PREFECT_WORKER_QUERY_SECONDS="2")
    log = open(home / "server.log", "w")  # noqa: SIM115 - closed at the fixture's end
    proc = subprocess.Popen([prefect_cli, "server", "start", "--host", "127.0.0.1", "--port", str(port)], env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 240
    while True:
        try:
            if httpx.get(f"{api}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"prefect server did not start:\n{(home / 'server.log').read_text()[-3000:]}")
        time.sleep(1)
    out = subprocess.run([prefect_cli, "work-pool", "create", PREFECT_POOL, "--type", "process", "--overwrite"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"cannot create the work pool:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    yield env, api
    from helpers.processes import stop_group

    stop_group(proc)
    log.close()


# ============================================================================= end server ===


def pytest_configure(config):
    """The third-party warnings ettflow's console drops by name (`ettflow.console.KNOWN_NOISE`)
    are ignored in tests too, by the same names; any other warning shows in the summary.

    Prefect configures its logging once, when `prefect.main` is first imported, and its console
    handler keeps the `sys.stderr` of that moment: imported inside a test that captures output
    (capsys), every later Prefect log line goes to that test's closed stream ("I/O operation
    on closed file"). Importing it here binds the session's stream."""
    import prefect.main  # noqa: F401

    from ettflow.console import KNOWN_NOISE

    for noise in KNOWN_NOISE:
        if noise.category is not None:  # pytest splits a filter on ':', so the regex says it as \x3a
            message = "(?s).*({})".format(noise.message.replace(":", r"\x3a"))
            config.addinivalue_line("filterwarnings", f"ignore:{message}:{noise.category.__name__}")


# Modules that must run after the rest of their level: the multinode cluster shuts the session's
# Ray down while it runs (one Ray connection per driver) and starts a fresh one after it.
RUN_LAST = ("test_multinode.py",)

# The suite runs on two pytest-xdist workers (scripts/test.sh: `-n 2`). Each test file is one
# unit of work, sent whole to one worker, so a file's module fixtures are built once; session
# fixtures are built at most once per worker. The files below share a unit because they share
# costly session fixtures (the real Prefect server, the measured runs of tests/e2e/conftest.py):
# apart, each worker started its own server for them.
UNITS = {**{name: "deployed-path" for name in ("test_automations.py", "test_browser.py", "test_deployed_crash.py",
                                                "test_deployed_pool.py")},
         **{name: "trainer" for name in ("test_trainer.py", "test_trainer_faults.py")}}  # e2e/conftest `clean_run`
# Under xdist the costliest units go first, largest first (as a two-worker run's durations rank
# them, setup included: `.ci/run` prints them), so that the two workers end about together; the
# rest keep their order; a costly file left out of the list runs among the last and keeps the
# other worker idle at the end (test_deployed_pool.py did: about 2.5 of a run's 34 minutes).
# (A worker takes its next unit while its last two tests still run.)
COSTLY_FIRST = ("trainer", "deployed-path", "test_local_stack.py", "test_fault_matrix.py", "test_continuous_refresh.py",
                "test_console.py", "test_bench.py", "test_refresh_process.py", "test_flow_refresh.py",
                "test_compile_cache.py")


def pytest_collection_modifyitems(config, items):
    first = {name: i for i, name in enumerate(COSTLY_FIRST)}
    if os.environ.get("PYTEST_XDIST_WORKER"):  # every worker collects, and must collect in one order
        items.sort(key=lambda item: first.get(UNITS.get(item.path.name, item.path.name), len(first)))
    items.sort(key=lambda item: item.path.name in RUN_LAST)  # stable: every other order is kept


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Units of work by file (`UNITS` joins some), in collection order (not reordered by size)."""
    from xdist.scheduler import LoadScopeScheduling

    class FileUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return UNITS.get(Path(path).name, path)

    config.option.loadscopereorder = False
    return FileUnits(config, log)
