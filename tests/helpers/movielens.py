"""MovieLens-100K source files made up in the recbole wheel's layout (no download)."""

import numpy as np

from ettflow.trainer.data.movielens import FILES


def fake_source(folder, n=60, seed=0):
    """Files in the ml-100k layout of the recbole wheel (tab-separated, typed headers)."""
    rng = np.random.default_rng(seed)
    folder.mkdir()
    inter = ["user_id:token\titem_id:token\trating:float\ttimestamp:float"]
    inter += [f"{rng.integers(1, 6)}\t{rng.integers(1, 5)}\t{rng.integers(1, 6)}\t"
              f"{rng.integers(8.7e8, 8.9e8)}" for _ in range(n)]
    items = ["item_id:token\tmovie_title:token_seq\trelease_year:token\tclass:token_seq",
             "1\tToy Story\t1995\tAnimation Children's Comedy", "2\tHeat \"X\"\t1995\tAction",
             "3\tFour Rooms\t1995\tThriller", "4\tSe7en\t1995\tCrime Thriller Drama Mystery"]
    users = ["user_id:token\tage:token\tgender:token\toccupation:token\tzip_code:token"]
    users += [f"{u}\t{20 + u}\t{'MF'[u % 2]}\tjob{u % 3}\tZ{u}X" for u in range(1, 6)]
    for name, lines in zip(FILES, (inter, items, users), strict=True):
        (folder / name).write_text("\n".join(lines) + "\n")
    return folder
