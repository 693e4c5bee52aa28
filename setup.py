"""Build hook: the wheel carries the repository's ``sample_runs/`` as ``logitscope/sample_runs/``.

The design keeps the sample runs in the top-level ``sample_runs/`` folder; a
wheel only installs packages, so the build copies that one folder into the
``logitscope`` package (no second copy lives in the repository, and a run
added to ``sample_runs/`` ships without further changes). Everything else is
in ``pyproject.toml``.

It also builds one optional extension, ``tracker.recording._rowstats`` (``tracker/recording/_rowstats.c``): the
statistics and top k of the rows a CPU run keeps in float16, bfloat16 or top-k storage, in two passes over each
row instead of a torch pass per statistic (inside a serving engine, every tracked row at every step). Without a
C compiler the install goes on and the recorder uses torch's kernels, as on an accelerator (the same values, the
statistics within float32 rounding).
"""

import sys
from pathlib import Path

from setuptools import Extension, setup
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


# -O3: the loops are written for the compiler to vectorise; -Wno-psabi: GCC notes that 32-byte vectors pass
# differently with AVX, which only the file's inlined helpers do (GCC and Clang flags)
ROWSTATS = Extension(
    "tracker.recording._rowstats",
    ["tracker/recording/_rowstats.c"],
    optional=True,
    extra_compile_args=[] if sys.platform == "win32" else ["-O3", "-Wno-psabi", "-ffp-contract=off"],
)

setup(cmdclass={"build_py": BuildWithSampleRuns}, ext_modules=[ROWSTATS])
