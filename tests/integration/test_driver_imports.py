"""A flow run's driver (the deployment run's own process) stays light: torch's import (~1.2 s
here, more on a GPU host) belongs to the rank processes, or a deployment run pays it on its
clock before its ranks start. Each check is a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_a_driver_keys_as_its_ranks_do_without_importing_torch():
    """A flow run's driver reads torch's version from its metadata (no 1.2 s import); a rank,
    with torch imported, from torch itself: the two must give one key."""
    code = ("import sys; from ettflow.trainer.compile.config import torch_version; v = torch_version(); "
            "assert 'torch' not in sys.modules; import torch; assert v == torch.__version__ == torch_version(), v; "
            "print(v)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_a_flow_runs_driver_imports_no_torch(tmp_path):
    """torch's import (~1.2 s here, more on a GPU host) belongs in the rank processes: a
    deployment run's flow process would pay it on its clock before the ranks start. The flow,
    its tasks, the driver, the Ray group and the pool service, the progress's step count and
    the compile cache's archive lookup import none of it."""
    code = textwrap.dedent(f"""
        import sys
        import ettflow.flows.refresh, ettflow.tasks.trainer, ettflow.trainer.group.driver
        import ettflow.trainer.group.ray_group, ettflow.trainer.group.pool_service, ettflow.trainer.group.spare_pool
        from ettflow.tasks.progress import planned_steps
        from ettflow.trainer.compile.process_cache import has_archive
        from ettflow.trainer.config import TrainerConfig
        from ettflow.trainer.data.schema import criteo_schema
        from ettflow.trainer.data.synthetic import SyntheticConfig, generate_windows
        generate_windows({str(tmp_path)!r}, SyntheticConfig(windows=2, rows_per_window=256, files_per_window=1))
        cfg = TrainerConfig(data_root={str(tmp_path)!r}, schema=criteo_schema(100), work_dir={str(tmp_path / 'w')!r},
                            compile_cache_root={str(tmp_path / 'c')!r}, batch_size=32, world_size=2)
        steps, archived = planned_steps(cfg), has_archive(cfg)
        loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith(("torch.", "torchrec", "fbgemm")))
        assert not loaded, loaded[:5]
        print(steps, archived)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["4", "False"]  # 256 rows, 1 window held out... of 2: 256 // 64


def test_every_commands_parser_is_built_without_the_libraries_its_work_needs():
    """`ettflow <anything>` builds the parser of every command first: pandas, pyarrow (the
    bench's tables, the data files' checks) and torch are imported where they are used, so a
    light command (`status`, `--help`, the tests' many CLI calls) starts in about half the time
    (1.2 s -> 0.57 s of CPU on this host)."""
    code = ("import sys; from ettflow.cli import build_parser; build_parser(); "
            "heavy = {'pandas', 'pyarrow', 'torch', 'ray', 'prefect'} & {m.split('.')[0] for m in sys.modules}; "
            "assert not heavy, sorted(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
