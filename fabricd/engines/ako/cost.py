"""How many partitions a rank's accumulated gradient is cut into (Ako §3.2, eq. 3).

Rules: this module turns what a rank measured -- the rate ``gamma`` at which it computes
gradients, the model's bytes ``m``, the number of ranks ``n`` and its bandwidth ``B`` -- into
the partition count ``p``; it measures nothing itself.

Theory of operation.  A round sends each of the ``n - 1`` peers one partition, ``m / p`` bytes,
so a rank that computes ``gamma`` gradients a second needs ``gamma * m * (n - 1) / p`` bytes a
second to keep its transmission delay constant.  With ``B`` bytes a second available (full
bisection bandwidth assumed, as in the paper),

    p = ceil(gamma * m * (n - 1) / B)                                          (eq. 3)

so the bytes a rank sends per second stay at about ``B`` however many ranks there are.

Choices where the paper is silent, and why:

* *Clamped to [1, elements].*  A fast network gives ``p < 1``: one partition, the whole
  accumulated gradient to every peer (all-to-all); more partitions than elements would send
  empty ones.
* *Units.*  ``m`` is the accumulated gradient's bytes as sent (the model's dtype), ``B`` bytes
  a second: the network monitor's figures for the node's uplink, or a configured one.
"""

from __future__ import annotations

import math

from fabricd.errors import UsageError


def partitions_for(
    *, gamma: float, model_bytes: int, ranks: int, bandwidth: float, elements: int
) -> int:
    """Eq. 3's ``p`` (module docstring), clamped to ``[1, elements]``.

    Raises:
        UsageError: a figure that is not finite and positive (``ranks`` >= 1, ``elements``
            >= 1; ``gamma`` may be 0: nothing computed yet, one partition).
    """
    if not (math.isfinite(gamma) and gamma >= 0):
        raise UsageError(f"a gradient rate is a finite number >= 0 per second, not {gamma}")
    if not (math.isfinite(bandwidth) and bandwidth > 0):
        raise UsageError(f"a bandwidth is a finite number > 0 of bytes per second, not {bandwidth}")
    if model_bytes < 1 or ranks < 1 or elements < 1:
        raise UsageError("a model of at least one element and byte, over at least one rank")
    p = math.ceil(gamma * model_bytes * (ranks - 1) / bandwidth)
    return min(max(1, p), elements)
