"""Pictures of the benchmark, where a person would rather look than read."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from ettflow.ett.events import L2_ORDER  # noqa: E402
from ettflow.ett.palette import COLOURS, MODE_COLOURS, REFERENCE_COLOUR  # noqa: E402


def components_bars(pairs: dict[int, tuple], path: Path) -> None:
    """Stacked L2 shares per job: baseline and optimized side by side at every length."""
    labels, shares = [], []
    for length, pair in pairs.items():
        for job in pair:
            m = job.metrics
            labels.append(f"{job.mode[:4]}\nL{length}")
            shares.append({c: 100 * m.components[c] / m.wall_s for c in L2_ORDER})
    frame = pd.DataFrame(shares, index=labels)
    ax = frame.plot.bar(stacked=True, color=[COLOURS[c] for c in frame.columns], figsize=(8, 4.5), rot=0, width=0.7)
    ax.set_ylabel("% of wall time")
    ax.set_title("Where each job's wall time went (L2), baseline vs optimized")
    ax.legend(loc="center left", bbox_to_anchor=(1, 0.5), fontsize=8)
    plt.tight_layout()
    plt.savefig(path, dpi=110)
    plt.close()


def ett_vs_length(frame: pd.DataFrame, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, group in frame.groupby("mode"):
        ax.plot(group["train_s"], group["ETT%"], marker="o", label=mode, color=MODE_COLOURS.get(mode))
    ax.set_xscale("log")
    ax.set_xlabel("training data per job (seconds of effective training)")
    ax.set_ylabel("ETT %")
    ax.set_title("ETT grows with job length; short jobs pay the most")
    ax.grid(alpha=0.3)
    ax.legend()
    plt.tight_layout()
    plt.savefig(path, dpi=110)
    plt.close()


def wasted_vs_interval(curve: pd.DataFrame, choice: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(curve["interval_s"], curve["wasted_s"], marker=".", color=COLOURS["wasted_training"])
    ax.axvline(choice["interval_s"], color=COLOURS["effective_training"], linestyle="--",
               label=f"optimizer: {choice['interval_s']:.1f} s ({choice['wasted_s']:.1f} s wasted)")
    ax.axvline(choice["young_s"], color=REFERENCE_COLOUR, linestyle=":", label=f"Young: {choice['young_s']:.1f} s")
    ax.set_xscale("log")
    ax.set_xlabel("checkpoint interval, s")
    ax.set_ylabel("expected wasted training, s")
    ax.set_title("WTT = UTT + NoS x CSBT (measured blocking, 3 failures)")
    ax.legend(fontsize=8)
    plt.tight_layout()
    plt.savefig(path, dpi=110)
    plt.close()


# TTS parts of `bench.refreshes` -> the L2 colour of the component each belongs to (restore is
# trainer init's, hatched so it stands apart)
TTS_PART_COLOURS = {"scheduling": COLOURS["scheduling"], "init": COLOURS["trainer_init"],
                    "restore": COLOURS["trainer_init"], "compile": COLOURS["pt2_compile"],
                    "other": COLOURS["unattributed"]}


def ett_per_refresh(frame: pd.DataFrame, path: Path) -> None:
    """Left: ETT% of each refresh of a sequence, one line per mode (cold refreshes hollow).
    Right: each refresh's TTS split into its parts, baseline and optimized side by side."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    modes = list(dict.fromkeys(frame["mode"]))
    for mode in modes:
        group = frame[frame["mode"] == mode]
        colour = MODE_COLOURS.get(mode)
        left.plot(group["refresh"], group["ETT%"], marker="o", color=colour, label=mode)
        cold = group[group["start"] == "cold"]
        left.scatter(cold["refresh"], cold["ETT%"], s=90, facecolors="white", edgecolors=colour, zorder=3)
        for x, y in zip(group["refresh"], group["ETT%"]):
            left.annotate(f"{y:.1f}", (x, y), textcoords="offset points", xytext=(0, 7), ha="center", fontsize=8,
                          color=colour)
    left.set_xticks(sorted(frame["refresh"].unique()))
    left.set_xlabel("refresh (one new window each; refresh 1 is cold)")
    left.set_ylabel("ETT %")
    left.set_ylim(0, max(10.0, 1.25 * float(frame["ETT%"].max())))
    left.set_title("ETT% per refresh")
    left.grid(alpha=0.3)
    left.legend()
    width = 0.8 / max(len(modes), 1)
    for i, mode in enumerate(modes):
        group = frame[frame["mode"] == mode]
        x = group["refresh"].to_numpy() + (i - (len(modes) - 1) / 2) * width
        bottom = 0.0
        for part, colour in TTS_PART_COLOURS.items():
            values = group[f"{part}_s"].to_numpy()
            right.bar(x, values, width * 0.95, bottom=bottom, color=colour, edgecolor="white",
                      hatch="//" if part == "restore" else None, label=part if i == 0 else None)
            bottom = bottom + values
    right.set_xticks(sorted(frame["refresh"].unique()))
    right.set_xlabel("refresh (" + ", ".join(f"{m} {'left' if j == 0 else 'right'}" for j, m in enumerate(modes))
                     + ")")
    right.set_ylabel("TTS, s")
    right.set_title("What each refresh's TTS is made of")
    right.legend(fontsize=8)
    plt.tight_layout()
    plt.savefig(path, dpi=110)
    plt.close()
