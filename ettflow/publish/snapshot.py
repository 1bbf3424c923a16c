"""The inference snapshot: the trained DLRM with int8 tables, as a TorchScript file.

Path (the one that works with torch 2.13 / torchrec 1.8 on CPU):
1. `quantize_inference_model` swaps the EmbeddingBagCollection for torchrec's quantized one:
   int8 row-wise tables (each row: int8 values plus its own fp16 scale and bias) served by
   fbgemm's inference TBE kernel. The MLPs stay float32.
2. `SnapshotModule` puts a plain-tensor signature in front of it (below), and
   `torchrec.fx.symbolic_trace` traces it (torchrec's tracer keeps KJT handling as leaf calls).
3. `torch.jit.script` of the traced graph; `torch.jit.save`. (torch.export fails on the int8
   module today; TorchScript carries the traced code, so loading needs neither torchrec nor
   ettflow, only the fbgemm ops: `import fbgemm_gpu` before `torch.jit.load` when quantized.)

Signature (what an inference server passes; all batch-first, CPU):
    probs = module(dense, values, lengths)
    dense   float32 [B, n_dense]   dense features, preprocessed as in training (nulls 0,
                                   sign(x) * log1p(|x|) when the schema says dense_log1p)
    values  int64   [sum(lengths)] ids, already reduced into each table (id % num_embeddings),
                                   feature-major: every id of feature 0, then feature 1, ...
    lengths int32   [n_sparse * B] ids per (feature, example), feature-major, features in
                                   the manifest's `signature.sparse` order
    probs   float32 [B]            click probability (sigmoid of the logit)
"""

# No `from __future__ import annotations` here: torch.fx would copy the string annotations
# of SnapshotModule.forward into its generated code as the unknown type `_torch_Tensor_`.
import warnings
from pathlib import Path

import torch
from torch import nn
from torchrec.models.dlrm import DLRM
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ettflow.trainer.data.schema import FeatureSchema

MODEL_FILE = "model.pt"
QUANT_FORMAT = "int8 row-wise (torchrec quantize_inference_model: int8 values + fp16 scale/bias per row)"


@torch.fx.wrap
def _features(keys: list[str], values: torch.Tensor, lengths: torch.Tensor) -> KeyedJaggedTensor:
    # fx.wrap: the tracer records a call instead of tracing into KJT's constructor, and
    # TorchScript compiles the call (KJT is scriptable).
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths)


class SnapshotModule(nn.Module):
    """(dense, values, lengths) -> click probabilities; the KJT is built inside."""

    def __init__(self, dlrm: nn.Module, sparse_names: list[str]) -> None:
        super().__init__()
        self.dlrm = dlrm
        self.sparse_names = sparse_names

    def forward(self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        features = _features(self.sparse_names, values, lengths)
        return torch.sigmoid(self.dlrm(dense, features).squeeze(-1))


def quantize_tables(dlrm: DLRM) -> nn.Module:
    """Swap the embedding tables for int8 row-wise ones (in place; returns the model)."""
    from torchrec.inference.modules import quantize_inference_model

    return quantize_inference_model(dlrm, quantization_dtype=torch.int8, output_dtype=torch.float)


def script_snapshot(dlrm: nn.Module, schema: FeatureSchema) -> torch.jit.ScriptModule:
    """The DLRM (float or quantized) behind the plain signature, traced and scripted."""
    from torchrec.fx import symbolic_trace

    module = SnapshotModule(dlrm, list(schema.sparse_names)).eval()
    for p in module.parameters():
        p.requires_grad_(False)
    with warnings.catch_warnings():  # about torchrec's own annotations; harmless here
        warnings.filterwarnings("ignore", message="The TorchScript type system doesn't support")
        warnings.filterwarnings("ignore", message="TorchScript will treat type annotations")
        scripted = torch.jit.script(symbolic_trace(module))
    return scripted.eval()


def save_snapshot(scripted: torch.jit.ScriptModule, folder: Path) -> Path:
    path = Path(folder) / MODEL_FILE
    torch.jit.save(scripted, str(path))
    return path


def signature(schema: FeatureSchema, quantized: bool) -> dict:
    """What the manifest says about calling the module."""
    return {
        "call": "probs = torch.jit.load(path)(dense, values, lengths)",
        "requires": ["torch", "fbgemm_gpu (import it before torch.jit.load)"] if quantized else ["torch"],
        "dense": {"dtype": "float32", "shape": ["B", len(schema.dense)], "columns": list(schema.dense),
                  "log1p": schema.dense_log1p},
        "values": {"dtype": "int64", "shape": ["sum(lengths)"],
                   "note": "ids reduced into each table (int ids: id % num_embeddings), feature-major"},
        "lengths": {"dtype": "int32", "shape": [f"{len(schema.sparse)} * B"], "order": "feature-major"},
        "sparse": [{"name": f.name, "num_embeddings": f.num_embeddings, "multi_valued": f.multi_valued}
                   for f in schema.sparse],
        "output": {"dtype": "float32", "shape": ["B"], "meaning": "click probability"},
    }
