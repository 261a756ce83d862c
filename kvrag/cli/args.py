"""argparse types shared by every `kvrag` command: a bad value is a one-line usage error, never a traceback."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

from kvrag.defaults import MAX_DRAFT_TOKENS, SHIPPED_SPECS, names_no_adapter


def _bounded(cast: Callable[[str], float], what: str, lo: float | None = None, hi: float | None = None) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if lo is not None and value < lo:
            raise argparse.ArgumentTypeError(f"must be at least {lo:g}, got {value:g}")
        if hi is not None and value > hi:
            raise argparse.ArgumentTypeError(f"must be at most {hi:g}, got {value:g}")
        return value

    return parse


positive_int = _bounded(int, "a whole number", lo=1)
draft_count = _bounded(int, "a whole number", lo=0, hi=MAX_DRAFT_TOKENS)
nonneg_float = _bounded(float, "a number", lo=0)
_unit = _bounded(float, "a number in [0, 1] or 'auto'", lo=0, hi=1)


def ratio_or_auto(text: str) -> float | str:
    """A recompute ratio in [0, 1], or 'auto' (chosen per request)."""
    return text if text == "auto" else _unit(text)


def link_adapter_arg(text: str) -> str | None:
    """`--link-adapter`: auto, links, tuned, none (None) or an adapter file that exists."""
    if names_no_adapter(text):
        return None
    if text in SHIPPED_SPECS:
        return text
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"expected auto, links, tuned, none or an adapter file, got {text!r} (no such file)")
    return text


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """`--help` for every kvrag command: an option's default shown once (not where its help already says
    it, nor for flags and unset options), and epilogs (the examples) one per line as written."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "default" in text.lower() or default is None or default is argparse.SUPPRESS or isinstance(default, bool) or default == []:
            return text
        return super()._get_help_string(action)


DECODE_WEIGHTS_HELP = ("what decoding reads after the first token: model (its own weights: the model's answers) or int8 "
                       "(CPU: ~1.4x tokens/s for the bundled model; answers may part from the model's after some tokens) "
                       "(default: model)")
