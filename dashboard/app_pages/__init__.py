"""The dashboard's pages: scripts that ``st.navigation`` runs (see :mod:`dashboard.app`); each only arranges widgets.

A package so that installs carry the scripts; they are run by path, never imported.
"""
