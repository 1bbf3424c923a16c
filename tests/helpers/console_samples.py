"""One real text per entry of the known-noise table, as the libraries print them."""

from __future__ import annotations

import re

from ettflow.console import Noise

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
    "dropped with caching_precompile": "BUILTIN_MATCH guard on G['__import_torchrec_dot_models_dot_dlrm'].torch.cat "
    "is dropped with caching_precompile=True.",
    "fbgemm_gpu\\S* is now DEPRECATED": "\n    The Python module fbgemm_gpu.split_table_batched_embeddings_ops is "
    "now DEPRECATED and will be removed",
    "Token authentication": "Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled",
    "Started a local Ray instance": "Started a local Ray instance.",
    "A worker died": "A worker died or was killed while executing a task by an unexpected system error.",
    "temporary server": "Starting temporary server on http://127.0.0.1:8080\nSee https://www.prefect.io/docs",
    "Beginning flow run": "Beginning flow run 'dlrm-optimized' for flow 'refresh-model'",
    "Finished in state Completed": "Finished in state Completed()",
    "Finished in state Failed": "Finished in state Failed(\"Flow run encountered an exception: ParameterError: "
    "parameter 'min_world_size' must be <= world_size (2), got 4\")",
}


def sample_for(noise: Noise) -> str:
    for key, text in SAMPLES.items():
        if re.search(key, noise.message) or key in noise.message:
            assert re.search(noise.message, text), (noise, text)
            return text
    raise AssertionError(f"tests/helpers/console_samples.py has no sample text for {noise}")
