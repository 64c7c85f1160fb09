"""Moved to :mod:`surgery.ops.rewrite.rewriting`: this old path warns and goes away in 0.4."""

import sys
import warnings

from surgery.ops.rewrite import rewriting as _moved

warnings.warn(
    "surgery.ops.rewriting moved to surgery.ops.rewrite.rewriting; the old path goes away in 0.4",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _moved
