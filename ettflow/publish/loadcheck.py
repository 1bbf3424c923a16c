"""Score a snapshot the way an inference server would: torch (+ fbgemm_gpu) only.

    python -I loadcheck.py SNAPSHOT.pt INPUTS.pt OUTPUT.pt

INPUTS.pt holds a list of (dense, values, lengths) batches; OUTPUT.pt gets
{"probs": Tensor[N], "blocked_imports": [...], "loaded": [...]}. `ettflow` and `torchrec` are
made unimportable before anything else runs, so a snapshot that needs the training code (or
torchrec's Python) fails here instead of in production. This file imports nothing from
ettflow and is run by path, never as part of the package.
"""

import importlib.abc
import sys
from pathlib import Path

BLOCKED = ("ettflow", "torchrec")
_attempts: list[str] = []


class _Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            _attempts.append(name)
            raise ImportError(f"{name} is blocked: a snapshot must load without the training code")
        return None


def main(argv: list[str]) -> int:
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]  # no sibling modules
    sys.meta_path.insert(0, _Blocker())
    import torch

    try:
        import fbgemm_gpu  # noqa: F401  registers the int8 embedding kernels TorchScript calls
    except ImportError:
        pass
    snapshot, inputs, output = argv[1:4]
    module = torch.jit.load(snapshot, map_location="cpu").eval()
    batches = torch.load(inputs, weights_only=True)
    with torch.no_grad():
        probs = [module(dense, values, lengths) for dense, values, lengths in batches]
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    torch.save({"probs": torch.cat(probs).float(), "blocked_imports": sorted(set(_attempts)),
                "loaded": loaded}, output)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
