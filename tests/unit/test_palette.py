"""One palette and one component order for every picture and table."""

from __future__ import annotations

import re

from ettflow.bench import plots
from ettflow.ett import palette, report, warehouse
from ettflow.ett.events import COMPONENTS, L2_ORDER, UNATTRIBUTED
from ettflow.tasks import timeline_plot


def test_every_l2_bucket_has_its_own_colour_in_the_shared_order():
    assert L2_ORDER == (*COMPONENTS, UNATTRIBUTED)
    assert tuple(palette.COLOURS) == L2_ORDER
    colours = list(palette.COLOURS.values())
    assert len(set(colours)) == len(colours)
    assert all(re.fullmatch(r"#[0-9a-f]{6}", c) for c in colours)


def test_failure_red_is_no_components_colour():
    assert palette.FAILURE_COLOUR not in palette.COLOURS.values()
    assert palette.PUBLISH_COLOUR not in palette.COLOURS.values()


def test_pictures_and_tables_use_the_shared_definitions():
    assert plots.COLOURS is palette.COLOURS
    assert timeline_plot.COLOURS is palette.COLOURS
    assert warehouse.COMPONENT_COLUMNS == tuple(f"{c}_s" for c in L2_ORDER)
    assert report.L2_ORDER is L2_ORDER
