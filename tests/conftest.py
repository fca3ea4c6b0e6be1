"""Suite-wide settings: no wall-clock thresholds, hypothesis's included.

Hypothesis by default fails an example that runs over 200 ms (``deadline``) and a strategy whose
first draws are slow (``HealthCheck.too_slow``).  Both are timings, and on a shared two-core
machine a cold first draw (imports, a fresh example database on a clean clone) can take over a
second: they would make CI red for reasons that say nothing about the code.  Every test still
stops by itself (pytest-timeout, bounded example counts).
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings

settings.register_profile("fabricd", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("fabricd")
