"""The run on disk: schema, stage names, layouts (Parquet files, datasets, spill folders), filesystems.

Imports nothing else of the tracker; pyarrow and numpy only.
"""
