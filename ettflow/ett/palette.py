"""The one palette of ettflow's pictures: a colour per L2 bucket and per mark.

Every picture (the Prefect timeline, the benchmark plots) takes its colours from here, so
a component is the same colour wherever a person sees it. Pure data: no matplotlib import.

- `COLOURS`: each name of `events.L2_ORDER` (the six components, then unattributed).
- `FAILURE_COLOUR`, `DETECTED_COLOUR`: the fault and detection markers; red is kept for
  faults alone, so no component is red.
- `PUBLISH_COLOUR`: CPU publishing after the devices were released (off the clock).
- `MODE_COLOURS`: baseline and optimized, where a picture compares the two.
- `REFERENCE_COLOUR`: guides and reference lines (a closed-form estimate beside the optimum).
"""

from __future__ import annotations

# Keys in `events.L2_ORDER` order (tests/test_palette.py holds them to it).
COLOURS: dict[str, str] = {
    "effective_training": "#2ca02c",  # green: time that trains new data
    "wasted_training": "#ff7f0e",  # orange: replay, save blocking, work lost in flight
    "pt2_compile": "#9467bd",  # purple
    "trainer_init": "#1f77b4",  # blue
    "scheduling": "#7f7f7f",  # grey
    "shutdown": "#8c564b",  # brown
    "unattributed": "#dddddd",  # light grey: no event covers it
}
FAILURE_COLOUR = "#d62728"
DETECTED_COLOUR = "#000000"
PUBLISH_COLOUR = "#17becf"
REFERENCE_COLOUR = "#7f7f7f"
MODE_COLOURS: dict[str, str] = {"baseline": "#7f7f7f", "optimized": "#2ca02c"}
