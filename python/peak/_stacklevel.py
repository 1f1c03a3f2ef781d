"""Warnings about the user's script name the script's line, through however many peak and torch
frames lie between (torch's optimizer hooks, an LR scheduler's wrapper, a gradient hook)."""
import contextlib
import os
import sys

import torch

_INTERNAL = (os.path.dirname(__file__) + os.sep, os.path.dirname(torch.__file__) + os.sep,
             contextlib.__file__)


def user_stacklevel() -> int:
    """``warnings.warn``'s ``stacklevel`` for the first frame outside peak, torch and contextlib
    (1 where there is none: a hook on an autograd device thread)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 1
