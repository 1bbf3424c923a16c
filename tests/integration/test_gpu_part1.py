"""The GPU check's part 1 (ettflow/bench/gpu_part1.py) on this CPU host, as a bare GPU host runs
it: in a fresh interpreter where TorchRec, fbgemm-gpu, Ray, Prefect and TorchRec's needs cannot
be imported. It must say that it is not a GPU result, pass every check, and exit 0. (Its compile
rows spawn two compiling processes, minutes here: left out, `--skip-compile`; the compile probe's
cold/warm run has its own test in test_compile_cache.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import ettflow

ROOT = Path(ettflow.__file__).parent.parent
BLOCKED = ("torchrec", "fbgemm_gpu", "ray", "prefect", "tensordict", "torchmetrics")


def test_part_one_runs_with_torch_alone_and_says_it_is_not_a_gpu_result(tmp_path):
    out = tmp_path / "part1.json"
    script = textwrap.dedent(f"""
        import runpy, sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {BLOCKED!r}:
                    raise ImportError("not on a bare GPU host: " + name)
        sys.meta_path.insert(0, Block())
        sys.argv = ["gpu_part1", "--skip-compile", "--state-mb", "16", "--repeats", "1", "--out", {str(out)!r}]
        runpy.run_module("ettflow.bench.gpu_part1", run_name="__main__")
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "NOT A GPU RESULT" in proc.stdout and "(on the CPU: not a GPU result)" in proc.stdout
    assert "skipped: compile cold/warm (--skip-compile)" in proc.stdout
    result = json.loads(out.read_text())
    checks = {r["check"]: r for r in result["rows"]}
    assert all(r["ok"] for r in result["rows"]), result["rows"]
    assert checks["training refuses a CPU tensor"]["value"].startswith("refused")
    assert checks["from the staged host copy, bitwise equal"]["value"].startswith("True")
    assert result["save"]["pinned"] is False
