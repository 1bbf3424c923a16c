"""`delta_snapshot`'s row arithmetic on hand-built TBE states: where each table's rows lie in a
flat int8 buffer (fbgemm pads every table to a 128-byte line, so a table's region is not its
rows' bytes), and that a diff applied to the base gives the new state bit for bit."""

from __future__ import annotations

import pytest
import torch

from ettflow.publish.delta_snapshot import DeltaSnapshotRefused, _tables, apply_state, diff_state

P = "tbes.0"
INT8, HOST = 2, 3


def state(rows: list[int], dim: int, *, seed: int = 0, pad: int = 128) -> dict[str, torch.Tensor]:
    """A TBE's state as torchrec's quantized tables hold it: int8 rows of dim + 4 bytes rounded
    to 16, each table's region rounded up to `pad` bytes (fbgemm's cache line)."""
    width = -(-(dim + 4) // 16) * 16
    sizes = [-(-(n * width) // pad) * pad for n in rows]
    offsets = [sum(sizes[:i]) for i in range(len(rows))]
    g = torch.Generator().manual_seed(seed)
    return {f"{P}.weights_placements": torch.full((len(rows),), HOST, dtype=torch.int32),
            f"{P}.weights_offsets": torch.tensor(offsets), f"{P}.rows_per_table": torch.tensor(rows),
            f"{P}.D_offsets": torch.arange(len(rows) + 1, dtype=torch.int32) * dim,
            f"{P}.weights_tys": torch.full((len(rows),), INT8, dtype=torch.uint8),
            f"{P}.weights_host": torch.randint(0, 256, (sum(sizes),), dtype=torch.uint8, generator=g),
            f"{P}.weights_uvm": torch.zeros(0, dtype=torch.uint8),
            "over.weight": torch.randn(3, 2, generator=g)}


def test_rows_are_found_in_tables_padded_to_a_cache_line():
    # 500 rows of dim 8 (16 bytes each) take 8,064 bytes: 8,000 padded to 128 (the bench's size
    # that made the old rule, region / rows, refuse); 2 rows take a whole line
    s = state([500, 2, 37], dim=8)
    assert _tables(s, f"{P}.weights_host") == [(0, 0, 500, 16), (1, 8064, 2, 16), (2, 8192, 37, 16)]
    assert _tables(state([10], dim=16), f"{P}.weights_host") == [(0, 0, 10, 32)]


def test_a_diff_applied_to_the_base_gives_the_new_state_bitwise():
    base, new = state([500, 2, 37], dim=8), state([500, 2, 37], dim=8)
    new[f"{P}.weights_host"] = base[f"{P}.weights_host"].clone()
    for t, row in ((0, 7), (0, 499), (1, 1), (2, 0)):  # change four rows, and a row's padding never
        off = _tables(base, f"{P}.weights_host")[t][1]
        new[f"{P}.weights_host"][off + 16 * row] ^= 0xFF
    new["over.weight"] = base["over.weight"] + 1
    tensors, stats = diff_state(base, new)
    assert stats == {"changed_rows": 4, "rows": 539}
    assert tensors[f"ids/{P}.weights_host/0"].tolist() == [7, 499] and "whole/over.weight" in tensors
    got = {k: v.clone() for k, v in base.items()}
    apply_state(got, tensors)
    assert all(torch.equal(got[k], new[k]) for k in new)


def test_a_table_that_does_not_fit_its_rows_is_refused():
    s = state([500], dim=8)
    s[f"{P}.weights_host"] = s[f"{P}.weights_host"][:7_000]  # fewer bytes than 500 rows of 16
    with pytest.raises(DeltaSnapshotRefused, match="500 rows of 16 bytes does not fill its 7000 bytes"):
        _tables(s, f"{P}.weights_host")
