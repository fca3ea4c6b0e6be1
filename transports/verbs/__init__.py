"""InfiniBand verbs transport (pyverbs).  This release has the device probe only.

docs/architecture.md describes how the verbs link fits the transport contract; until it lands
the daemon uses TCP and says why in one log line (see :func:`device.probe`).
"""

from __future__ import annotations
