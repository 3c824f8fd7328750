"""Whether a sharding spec fits a tensor: the messages the front end and ``planc.model.infer`` share.

A written spec is checked by the front end against a declared type; a spec derived or a type
measured on the model is checked by ``infer``. Both say the same thing, so the words live here,
outside ``planc.lang``, where a pass can use them without loading the parser.
"""

from __future__ import annotations

import math

__all__ = ["spec_length_error", "spec_divide_error"]


def spec_length_error(entries: int, shape) -> str | None:
    """The message for a spec whose entry count is not the tensor's rank (None: it is)."""
    if entries == len(shape):
        return None
    return (f"the spec has {entries} entries but the tensor has {len(shape)} dimensions "
            f"{list(shape)}; write one entry per dimension")


def spec_divide_error(tdim: int, size: int, axes: tuple[int, ...], mesh_shape, stage: int) -> str | None:
    """The message for tensor dimension ``tdim`` of ``size`` not dividing over mesh ``axes`` (None: it does)."""
    n = math.prod(mesh_shape[a] for a in axes)
    if size % n == 0:
        return None
    return (f"tensor dimension {tdim} of size {size} does not divide evenly over mesh size {n} "
            f"(stage {stage}, {'S' + ''.join(map(str, axes))})")
