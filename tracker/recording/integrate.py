"""``add_tracking(generator)``: put a tracker around a generator's logits processor.

Works with logitscope's ``sampling.Generator`` and with anything that holds
its processor in ``.logits_processor`` and resets it through ``reset()`` (an
Outlines 1.x ``Generator``). With ``model.generate`` there is no generator
object to change: pass a :class:`~tracker.LogitTrackingProcessor` in
``logits_processor=[...]`` (see :mod:`tracker.recording.processor`).

When the generator exposes sampling taps (``generator.sample_taps``, a list of
observers handed the distribution actually sampled from, after temperature,
top-k, top-p and min-p), the tracker also records that as the ``"sampled"``
stage.
"""

from __future__ import annotations

from typing import Any, TypeVar

from processors import ProcessorList
from tracker.recording.hosts import find_tokenizer
from tracker.recording.processor import LogitTrackingProcessor

__all__ = ["add_tracking"]

G = TypeVar("G")


def _model_name(generator: Any) -> str | None:
    model = getattr(generator, "model", None)
    for holder in (model, getattr(model, "model", None)):
        config = getattr(holder, "config", None)
        name = getattr(config, "_name_or_path", None)
        if name:
            return str(name)
    return None


def add_tracking(generator: G, tracker: LogitTrackingProcessor | None = None, **options: Any) -> G:
    """Wrap ``generator.logits_processor`` in a tracker; returns the same generator.

    Args:
        generator: logitscope's ``Generator``, an Outlines 1.x ``Generator``,
            or any object with a ``logits_processor`` attribute.
        tracker: a tracker to install (it wraps the current processor when it
            wraps none); by default one is made with ``options``
            (``storage=``, ``top_k=``, ``memory_limit=``, ... as for
            :class:`~tracker.LogitTrackingProcessor`). The tokenizer, the
            model's name and the end-of-sequence ids are taken from the
            generator unless given.

    Raises:
        TypeError: the generator has no ``logits_processor`` attribute.

    Calling it twice leaves the first tracker in place. The tracker is then
    ``generator.logits_processor``.
    """
    if not hasattr(generator, "logits_processor"):
        raise TypeError(
            f"add_tracking: generator must have a logits_processor attribute (logitscope's Generator, an "
            f"Outlines 1.x Generator), got {type(generator).__name__} without one. With transformers' "
            "model.generate, pass LogitTrackingProcessor(...) in logits_processor=[...] instead."
        )
    current = generator.logits_processor
    if isinstance(current, LogitTrackingProcessor):
        return generator
    if isinstance(current, ProcessorList) and len(current) == 0:
        current = None  # nothing to wrap: record the model's own distribution only
    if tracker is None:
        options.setdefault(
            "tokenizer",
            find_tokenizer(getattr(generator, "tokenizer", None), getattr(generator, "model", None), current),
        )
        options.setdefault("model", _model_name(generator))
        eos = getattr(generator, "eos_token_ids", None)
        if eos:
            options.setdefault("eos_token_id", list(eos))
        tracker = LogitTrackingProcessor(current, **options)
    elif options:
        raise TypeError(f"add_tracking: give either tracker or options, not both (got options {sorted(options)})")
    elif tracker.processor is None and current is not None:
        raise ValueError(
            "add_tracking: the tracker given wraps no processor but the generator has one; "
            "make it with LogitTrackingProcessor(generator.logits_processor, ...)"
        )
    if tracker.pad_model is None:  # its generation_config's pad id counts when the tokenizer has none
        model = getattr(generator, "model", None)
        tracker.pad_model = next(
            (m for m in (model, getattr(model, "model", None)) if hasattr(m, "generation_config")), None
        )
    generator.logits_processor = tracker  # type: ignore[attr-defined]
    taps = getattr(generator, "sample_taps", None)
    if isinstance(taps, list):
        tracker.add_stage("sampled")
        if tracker.sample_tap not in taps:
            taps.append(tracker.sample_tap)
    return generator
