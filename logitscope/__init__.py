"""logitscope: see tracker, processors, sampling and dashboard.

This package holds what sits on top of the four library packages: the
command line (``logitscope.cli``) and the shipped demo model
(``logitscope.demo_model``).
"""

__version__ = "0.1.0"
