"""logitscope's own tiny demo model: a 1 M-parameter GPT-2 that ships with the package.

It lets the toolkit's tests, examples and dashboard run fully offline, with no
Hugging Face hub, in well under a second per generation on CPU.  It was trained
by :mod:`logitscope.demo_model.train` on the synthetic corpus of
:mod:`logitscope.demo_model.corpus` (JSON person records, phone numbers,
arithmetic, template prose), so it produces recognisable structure.

    >>> from logitscope.demo_model import load_demo_model
    >>> model, tokenizer = load_demo_model()

Importing this package is cheap: transformers is only imported by
:func:`load_demo_model`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

__all__ = ["DEMO_MODEL_PATH", "REGENERATE_COMMAND", "load_demo_model"]

#: Folder holding the committed model and tokenizer files.
DEMO_MODEL_PATH: Path = Path(__file__).resolve().parent / "files"

#: Command (run from the repository root) that rebuilds :data:`DEMO_MODEL_PATH`.
REGENERATE_COMMAND = "python -m logitscope.demo_model.train"

_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def load_demo_model(
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """Load the demo model (in eval mode, on ``device``, in ``dtype``) and its tokenizer.

    Loads from :data:`DEMO_MODEL_PATH` with ``local_files_only=True``, so it
    never touches the network.  Raises :class:`FileNotFoundError` naming the
    folder and the regeneration command if the committed files are missing.
    """
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    missing = [name for name in _REQUIRED_FILES if not (DEMO_MODEL_PATH / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"demo model files missing from {DEMO_MODEL_PATH} ({', '.join(missing)}); "
            f"regenerate them with `{REGENERATE_COMMAND}` from the repository root"
        )

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    progress_bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Loading weights" bar for a 4 MB file
    try:
        tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_PATH, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL_PATH, local_files_only=True, dtype=dtype)
    finally:
        if progress_bar:
            hf_logging.enable_progress_bar()
    model.to(device)
    model.eval()
    return model, tokenizer
