"""Every torch internal ettflow relies on is reached through `ettflow.trainer._torch_compat`,
and a torch without one of them fails here, loudly, naming it and the torch version."""

import ast
import importlib
from pathlib import Path

import pytest
import torch

from ettflow.trainer import _torch_compat as compat
from ettflow.trainer._torch_compat import TorchCompatError

PACKAGE = Path(compat.__file__).resolve().parents[1]
ROOTS = {"torch", "torchrec", "fbgemm_gpu"}  # packages whose private parts only the compat module may use
# private attributes of torch objects (on any receiver: a ShardedTensor, a module alias)
PRIVATE_ATTRS = {"_process_group", "_HEADER_DIR", "_HEADER_LOCK_DIR", "_pool_set", "_precompile_header",
                 "_init_from_local_shards", "_init_from_local_shards_and_global_metadata", "_remote_device"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _dotted(node: ast.AST) -> list[str]:
    """`torch.a._b` -> ["torch", "a", "_b"] ([] for anything but names and attributes)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else []


def torch_internals_in(source: str) -> list[tuple[int, str]]:
    """(line, what) of each torch internal the code uses: a private module of ROOTS imported, a
    private name imported from one, a private part in a `torch....` chain, or a known private attribute.
    Strings, docstrings and comments do not count."""
    found = []
    nodes = list(ast.walk(ast.parse(source)))
    inner = {id(n.value) for n in nodes if isinstance(n, ast.Attribute)}  # report `a._b.c` once
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names
                      if a.name.split(".")[0] in ROOTS and any(map(_private, a.name.split(".")))]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ROOTS:
            if any(map(_private, node.module.split("."))) or any(_private(a.name) for a in node.names):
                found.append((node.lineno, f"from {node.module} import {', '.join(a.name for a in node.names)}"))
        elif isinstance(node, ast.Attribute):
            chain = _dotted(node)
            if node.attr in PRIVATE_ATTRS or (id(node) not in inner and chain[:1] and chain[0] in ROOTS
                                              and any(map(_private, chain))):
                found.append((node.lineno, ".".join(chain) or node.attr))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant) and node.args[1].value in PRIVATE_ATTRS):
            found.append((node.lineno, f"{node.func.id}(..., {node.args[1].value!r})"))
    return sorted(found)


def test_every_torch_internal_is_there():
    missing = compat.check_all()
    assert not missing, (
        f"torch {torch.__version__} broke {len(missing)} internal(s) ettflow relies on "
        "(port ettflow/trainer/_torch_compat.py):\n" + "\n".join(missing)
    )


def test_no_torch_internal_outside_the_compat_module():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name != "_torch_compat.py":
            rel = path.relative_to(PACKAGE.parent)
            found += [f"{rel}:{line}: {what}" for line, what in torch_internals_in(path.read_text())]
    assert not found, "torch internals used outside ettflow/trainer/_torch_compat.py:\n" + "\n".join(found)


def test_the_scan_finds_what_the_compat_module_replaced():
    code = """
from torch._dynamo.utils import counters
from torch.distributed.remote_device import _remote_device
import torch._inductor.codecache
x = torch._dynamo.callback_handler
st._init_from_local_shards_and_global_metadata(shards, md, process_group=original._process_group)
log = "torch.fx._symbolic_trace"  # a logger name in a string: not a use
pg = make()._process_group.rank()
pools = getattr(sys.modules.get("torch._inductor.async_compile"), "_pool_set", ())
"""
    assert [line for line, _ in torch_internals_in(code)] == [2, 3, 4, 5, 6, 6, 8, 9]


def test_a_missing_header_dir_names_the_internal_and_the_torch_version(monkeypatch, tmp_path):
    codecache = importlib.import_module("torch._inductor.codecache")
    before = codecache._HEADER_DIR
    monkeypatch.delattr(codecache, "_HEADER_DIR")
    with pytest.raises(TorchCompatError) as err:
        compat.redirect_precompiled_header_dir(tmp_path / "headers")
    message = str(err.value)
    assert message.startswith(f"torch {torch.__version__} has no torch._inductor.codecache._HEADER_DIR: ")
    assert "cannot redirect the precompiled header" in message and "_torch_compat.py" in message
    assert err.value.internal == "torch._inductor.codecache._HEADER_DIR"
    assert err.value.torch_version == torch.__version__
    assert codecache._HEADER_LOCK_DIR != str(tmp_path / "headers" / "locks")  # nothing half-set
    assert [m for m in compat.check_all() if "._HEADER_DIR:" in m] == [message]
    monkeypatch.undo()
    assert codecache._HEADER_DIR == before


def test_a_missing_pool_set_is_an_error_not_no_workers(monkeypatch):
    async_compile = importlib.import_module("torch._inductor.async_compile")
    assert compat.compile_workers_started() is False
    monkeypatch.delattr(async_compile, "_pool_set")
    with pytest.raises(TorchCompatError, match=r"has no torch\._inductor\.async_compile\._pool_set: .*compile workers"):
        compat.compile_workers_started()


def test_missing_dynamo_and_sharded_tensor_internals_are_named(monkeypatch):
    with pytest.raises(TorchCompatError, match=r"ShardedTensor\._process_group: async checkpoints"):
        compat.sharded_tensor_like(object(), [], None)
    utils = importlib.import_module("torch._dynamo.utils")
    monkeypatch.delattr(utils, "get_compilation_metrics")
    with pytest.raises(TorchCompatError, match=r"torch\._dynamo\.utils\.get_compilation_metrics: "):
        compat.recorded_recompile_reasons()
    missing = compat.check_all()
    assert len(missing) == 1 and f"torch {torch.__version__} has no" in missing[0]


def test_compile_ids_and_triggers():
    callback = importlib.import_module("torch._dynamo.callback")
    dynamo = callback.CallbackArgs(callback_trigger=callback.CallbackTrigger.DYNAMO, compile_id="3/1")
    lazy = callback.CallbackArgs(callback_trigger=callback.CallbackTrigger.LAZY_BACKWARD, compile_id="3/0")
    assert compat.dynamo_compile_id(dynamo) == "3/1" and compat.dynamo_compile_id(lazy) is None
    assert compat.frame_compile_index("3/1") == 1 and compat.frame_compile_index("3/0") == 0
    seen = []
    compat.add_compile_start_callback(seen.append)
    compat.add_compile_start_callback(seen.append)  # once, however often added
    try:
        handler = importlib.import_module("torch._dynamo").callback_handler
        assert handler.start_callbacks.count(seen.append) == 1
    finally:
        compat.remove_compile_start_callback(seen.append)
    assert seen.append not in handler.start_callbacks
    compat.remove_compile_start_callback(seen.append)  # not added: nothing
