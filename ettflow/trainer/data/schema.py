"""The declared schema of a data window.

A `FeatureSchema` names the dense features, the sparse (categorical) features with the size of
their embedding tables, and the label. Ids are reduced into the table: integer ids modulo
`num_embeddings`, string ids by a stable hash, so any id a file holds maps to a valid row.

The check of a file against it is `parquet_check.validate_parquet` (pyarrow's, apart: the CLI
imports this module for the trainer config's types, and pyarrow's import is not its to pay).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


class DataError(ValueError):
    """Data that cannot be trained on; says which file, which column, and what is wrong."""

    explained = True  # shown without a traceback (`ettflow.console`)

    def __init__(self, file: str | Path, column: str | None, what: str):
        self.file, self.column, self.what = str(file), column, what
        where = f"{self.file}: column {column!r}" if column else self.file
        super().__init__(f"{where} {what}")

    def __reduce__(self):  # travels between processes (Ray) with its fields
        return (DataError, (self.file, self.column, self.what))


@dataclass(frozen=True, kw_only=True)
class SparseFeature:
    """A categorical feature: integer or string ids, one per row or a list per row."""

    name: str
    num_embeddings: int
    multi_valued: bool = False

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"SparseFeature.name must be a non-empty string, got {self.name!r}")
        if isinstance(self.num_embeddings, bool) or not isinstance(self.num_embeddings, int) or (
            self.num_embeddings < 1
        ):
            raise ValueError(
                f"SparseFeature {self.name!r}: num_embeddings must be an int >= 1 (the size of "
                f"its embedding table), got {self.num_embeddings!r}"
            )


@dataclass(frozen=True, kw_only=True)
class FeatureSchema:
    """Which columns a window holds and how they feed the model.

    dense: numeric columns (int or float; nulls read as 0), in model input order.
    sparse: categorical columns, in KeyedJaggedTensor key order.
    label: numeric or bool column, 1 = click.
    dense_log1p: apply sign(x) * log1p(|x|) to dense values (raw counts, as in Criteo).
    """

    dense: tuple[str, ...]
    sparse: tuple[SparseFeature, ...]
    label: str
    dense_log1p: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "dense", tuple(self.dense))
        object.__setattr__(self, "sparse", tuple(self.sparse))
        if not self.sparse:
            raise ValueError("FeatureSchema.sparse is empty: declare at least one sparse feature")
        if not all(isinstance(f, SparseFeature) for f in self.sparse):
            raise ValueError("FeatureSchema.sparse must hold SparseFeature values")
        names = [*self.dense, *(f.name for f in self.sparse), self.label]
        if not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"FeatureSchema column names must be non-empty strings: {names}")
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"FeatureSchema names columns more than once: {dupes}; "
                             "each column can be dense, sparse or the label, not two of them")

    @property
    def sparse_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.sparse)

    @property
    def columns(self) -> tuple[str, ...]:
        """Every column the pipeline reads (others in the files are ignored)."""
        return (*self.dense, *self.sparse_names, self.label)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"dense": list(self.dense),
                               "sparse": [asdict(f) for f in self.sparse]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FeatureSchema:
        unknown = set(d) - {"dense", "sparse", "label", "dense_log1p"}
        if unknown:
            raise ValueError(f"FeatureSchema: unknown fields {sorted(unknown)}")
        return cls(dense=tuple(d.get("dense", ())),
                   sparse=tuple(SparseFeature(**f) for f in d["sparse"]),
                   label=d["label"], dense_log1p=bool(d.get("dense_log1p", False)))


CRITEO_DENSE = tuple(f"int_{i}" for i in range(13))
CRITEO_SPARSE = tuple(f"cat_{i}" for i in range(26))


def criteo_schema(num_embeddings: int | Sequence[int] = 100_000) -> FeatureSchema:
    """The schema of `ettflow data generate` windows (and of Criteo converted likewise)."""
    sizes = [num_embeddings] * 26 if isinstance(num_embeddings, int) else list(num_embeddings)
    if len(sizes) != 26:
        raise ValueError(f"criteo_schema: need 26 table sizes, got {len(sizes)}")
    return FeatureSchema(
        dense=CRITEO_DENSE,
        sparse=tuple(SparseFeature(name=n, num_embeddings=s)
                     for n, s in zip(CRITEO_SPARSE, sizes, strict=True)),
        label="label",
        dense_log1p=True,
    )


def movielens_schema() -> FeatureSchema:
    """The schema of `ettflow data movielens` windows (MovieLens-100K, vocab-encoded ids)."""
    tables = {"user_id": 1024, "item_id": 2048, "genres": 32, "gender": 4,
              "occupation": 32, "zip": 1024}
    return FeatureSchema(
        dense=("age",),
        sparse=tuple(SparseFeature(name=n, num_embeddings=s, multi_valued=n == "genres")
                     for n, s in tables.items()),
        label="label",
        dense_log1p=True,
    )
