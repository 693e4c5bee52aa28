"""dashboard: the Streamlit app that replays recorded runs step by step.

Three layers, as in Streamlit's own guidance:

- data: :mod:`dashboard.reader` (a run on disk read by step, never whole),
  :mod:`dashboard.discover` (the runs under a path), :mod:`dashboard.views`
  (run data shaped into tables for the charts; pure) and :mod:`dashboard.data`
  (the same behind Streamlit's caches);
- charts: :mod:`dashboard.charts` (plotly figures) and :mod:`dashboard.text`
  (the coloured token text), pure functions of those tables;
- pages: :mod:`dashboard.app` (``st.navigation``) and ``dashboard/app_pages/``,
  which only arrange widgets, with :mod:`dashboard.widgets` for the pickers
  every page shares. (Not ``pages/``: that folder name beside the entry
  script turns on Streamlit's older multipage mode.)

Around them: :mod:`dashboard.serve` starts the server (``logitscope
dashboard [PATH]``), :mod:`logitscope.samples` records the sample runs
(``python -m logitscope.make_sample_runs`` rebuilds ``sample_runs/``;
``logitscope demo`` records them afresh), :mod:`dashboard.synthetic` makes
runs without a model for tests and benchmarks, :mod:`dashboard.paths` says
where things are, and :mod:`dashboard.threads` keeps torch, where it is
loaded, on one thread for the dashboard's small computations. Viewing runs
needs no torch: the pages read runs through :mod:`tracker.format.layout`.
"""
