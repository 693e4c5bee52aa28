"""Helpers for the dashboard's AppTest tests: the figures a page draws, whichever element draws them."""

from __future__ import annotations

import json

from streamlit.testing.v1 import AppTest

from dashboard import live_chart


def chart_specs(at: AppTest) -> list[str]:
    """Each figure on the page as plotly.py's JSON: those of ``st.plotly_chart``, then those of the live chart
    (Step replay's, :mod:`dashboard.live_chart`), which carries its figure in the component's arguments."""
    specs = [chart.proto.spec for chart in at.get("plotly_chart")]
    for element in at.get("component_instance"):
        if element.proto.component_name.endswith(f".{live_chart.COMPONENT}"):
            specs.append(json.loads(element.proto.json_args)["spec"])
    return specs
