"""dashboard: the Streamlit app that replays recorded runs step by step.

Three layers, as in Streamlit's own guidance:

- data: :mod:`dashboard.reader` (a run on disk read by step),
  :mod:`dashboard.discover` (the runs under a path), :mod:`dashboard.views`
  (run data shaped into tables for the charts; pure) and
  :mod:`dashboard.data` (the same behind Streamlit's caches);
- charts: :mod:`dashboard.charts` (plotly figures) and :mod:`dashboard.text`
  (the coloured token text), pure functions of those tables;
- pages: :mod:`dashboard.app` (``st.navigation``) and ``dashboard/pages/``,
  which only arrange widgets.

``logitscope dashboard [PATH]`` starts it; ``python -m dashboard.make_sample_runs``
rebuilds the shipped ``sample_runs/``.
"""
