"""Build hook: the wheel carries the repository's ``sample_runs/`` as ``logitscope/sample_runs/``.

The design keeps the sample runs in the top-level ``sample_runs/`` folder; a
wheel only installs packages, so the build copies that one folder into the
``logitscope`` package (no second copy lives in the repository, and a run
added to ``sample_runs/`` ships without further changes). Everything else is
in ``pyproject.toml``.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


class BuildWithSampleRuns(build_py):
    """``build_py`` that also copies ``sample_runs/*`` into ``logitscope/sample_runs/`` of the build."""

    def run(self) -> None:
        super().run()
        if self.editable_mode:  # an editable install reads sample_runs/ where it is
            return
        target = Path(self.build_lib) / "logitscope" / "sample_runs"
        self.mkpath(str(target))
        for source in sorted((HERE / "sample_runs").iterdir()):
            if source.is_file() and source.suffix in (".parquet", ".arrow", ".md"):
                self.copy_file(str(source), str(target / source.name))


setup(cmdclass={"build_py": BuildWithSampleRuns})
