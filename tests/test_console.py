"""Clean console output (`ettflow.console`): the known third-party noise is dropped by name,
ettflow's own lines stay, and `--verbose` shows everything.

The unit tests emit each known message in a fresh Python process (warnings filters and
logger filters are process-global, so never in pytest's own). The end-to-end test runs the
real `ettflow refresh` twice in one `ETTFLOW_HOME` (the second one reuses the first one's
compile cache): the default (with its induced failure) must print fewer than 40 lines and
no third-party warning; `--verbose` must show those warnings again.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ettflow.console import KNOWN_NOISE, Noise, ray_skip_regex

ROOT = Path(__file__).resolve().parents[1]
ETTFLOW = Path(sys.executable).with_name("ettflow")

# One real text per entry of KNOWN_NOISE (as the libraries print them), by source and pattern.
SAMPLES = {
    "topology was constructed directly": "The topology was constructed directly rather than via "
    "TopologyFactory.create_topology(). Please use TopologyFactory",
    "dense tensor size calculation": "There is a known issue with TorchRec's dense tensor size calculation in dry "
    "run scenarios",
    "HeuristicalStorageReservation": "HeuristicalStorageReservation is known to cause issues, particularly during "
    "dry run",
    "deprecating ShardedTensor": "Please use DTensor instead and we are deprecating ShardedTensor.",
    "is_fx_tracing": "is_fx_tracing will return true for both fx.symbolic_trace and torch.export.",
    "Failed to import: fbgemm_gpu": "\x1b[93m\n        Failed to import: fbgemm_gpu.split_embedding_codegen_lookup_"
    "invokers.lookup_adam_ssd\n        \x1b[0m",
    "fbgemm_gpu\\S* is now DEPRECATED": "\n    The Python module fbgemm_gpu.split_table_batched_embeddings_ops is "
    "now DEPRECATED and will be removed",
    "Token authentication": "Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled",
    "Started a local Ray instance": "Started a local Ray instance.",
    "A worker died": "A worker died or was killed while executing a task by an unexpected system error.",
    "temporary server": "Starting temporary server on http://127.0.0.1:8080\nSee https://www.prefect.io/docs",
    "Beginning flow run": "Beginning flow run 'dlrm-optimized' for flow 'refresh-model'",
    "Finished in state Completed": "Finished in state Completed()",
}

# What a third-party warning looks like on the console (the known ones, and the shapes of any
# other): a Python warning line, a library logger's WARNING, torch's own log prefix, Ray's notes.
THIRD_PARTY = re.compile(
    "|".join([ray_skip_regex(), r"\b\w+Warning: ", r"WARNING:(torch|torchrec|fbgemm|ray|prefect)",
              r"\[rank\d+\]:[WE]\d{4}", r"\(raylet\)", r"Ray deduplicates logs", r"auth_token"])
)


def sample_for(noise: Noise) -> str:
    for key, text in SAMPLES.items():
        if re.search(key, noise.message) or key in noise.message:
            assert re.search(noise.message, text), (noise, text)
            return text
    raise AssertionError(f"tests/test_console.py has no sample text for {noise}")


def emit_script(verbose: bool) -> str:
    """A program that installs the table (or not) and then emits every known message."""
    lines = ["import logging, sys, warnings", "from ettflow.console import KNOWN_NOISE, quiet_third_party",
             "logging.basicConfig(level=logging.INFO, stream=sys.stdout, format='LOG %(name)s %(message)s')",
             "warnings.simplefilter('always')", f"quiet_third_party(verbose={verbose})",
             "logging.getLogger('ettflow.own').warning('ettflow own line')"]
    for n in KNOWN_NOISE:
        text = sample_for(n)
        if n.category is not None:
            lines.append(f"warnings.warn({text!r}, {n.category.__name__})")
        elif n.logger is not None:
            lines.append(f"logging.getLogger({n.logger!r}).warning({text!r})")
    lines.append("logging.getLogger('torchrec.distributed.planner.types').warning('an unknown torchrec warning')")
    return "\n".join(lines)


def run_python(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("ETTFLOW_VERBOSE", "RAY_DEDUP_LOGS_SKIP_REGEX")}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120, check=True)
    return done.stdout + done.stderr


def test_every_entry_names_one_kind_of_source_and_has_a_sample():
    for n in KNOWN_NOISE:
        assert not (n.category and n.logger), n
        sample_for(n)
    with pytest.raises(ValueError, match="not both"):
        Noise(source="x", message="y", category=UserWarning, logger="z")
    with pytest.raises(ValueError, match="regular expression"):
        Noise(source="x", message="(")


def test_quiet_drops_exactly_the_known_messages_and_verbose_keeps_them():
    quiet = run_python(emit_script(verbose=False))
    loud = run_python(emit_script(verbose=True))
    assert "ettflow own line" in quiet and "an unknown torchrec warning" in quiet  # not in the table: kept
    for n in KNOWN_NOISE:
        if n.category is None and n.logger is None:
            continue  # a Ray-forwarded line: dropped by the driver (checked end to end)
        text = max(sample_for(n).splitlines(), key=len).strip()[:40]
        assert text not in quiet, n
        assert text in loud, n


def test_the_ray_skip_regex_matches_every_sample_and_no_ettflow_line():
    skip = re.compile(ray_skip_regex())
    assert all(skip.search(sample_for(n)) for n in KNOWN_NOISE)
    for own in ("attempt 0 failed (infrastructure failure: rank 1: process died)", "trainer reserved in 3.1 s",
                "training: step 18/32 (56%), attempt 1, loss 0.5017", "published /tmp/x (step 32) in 7.5 s"):
        assert not skip.search(own)


def test_quiet_mode_is_passed_to_child_processes():
    code = ("import os; from ettflow.console import quiet_third_party, verbose_from_env\n"
            "quiet_third_party(verbose={v}); print(verbose_from_env(), os.environ.get('RAY_DEDUP_LOGS_SKIP_REGEX') "
            "is not None)")
    assert run_python(code.format(v=False)).split() == ["False", "True"]
    assert run_python(code.format(v=True)).split() == ["True", "False"]


def refresh(home: Path, *args: str) -> list[str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "ETTFLOW_VERBOSE", "RAY_DEDUP_LOGS_SKIP_REGEX", "ETTFLOW_WAREHOUSE_URL")}
    env.update(ETTFLOW_HOME=str(home), RAY_USAGE_STATS_ENABLED="0", PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="180")
    done = subprocess.run([str(ETTFLOW), "refresh", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    out = (done.stdout + done.stderr).splitlines()
    assert done.returncode == 0, "\n".join(out[-60:])
    return out


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_default_refresh_is_short_and_free_of_third_party_warnings(tmp_path):
    quiet = refresh(tmp_path)  # the default: 2 ranks, one induced SIGKILL and its recovery
    noisy = [line for line in quiet if THIRD_PARTY.search(line)]
    assert not noisy and len(quiet) < 40, (f"{len(quiet)} lines, {len(noisy)} of them third-party:\n"
                                           + "\n".join(noisy) + "\n---- all of it:\n" + "\n".join(quiet))
    text = "\n".join(quiet)
    for own in ("ettflow refresh:", "trainer reserved", "attempt 0 failed", "trained to step", "published",
                "effective_training", "snapshot:"):
        assert own in text, own

    # warm compile cache; the same windows again (explicit windows win: past the watermark it would be skipped)
    loud = refresh(tmp_path, "--verbose", "--no-failure", "--max-steps", "8",
                   "--param", 'windows=["window=2024010100", "window=2024010101"]')
    assert len(loud) > len(quiet), f"--verbose printed {len(loud)} lines, the default {len(quiet)}"
    assert any(THIRD_PARTY.search(line) for line in loud), "--verbose showed no third-party line"
    assert any(re.search(r"topology was constructed directly|is_fx_tracing", line) for line in loud)
