"""The network monitor (MLfabric §4, §7): every node's available up/down bandwidth and RTT.

A scheduler reads it as ``host.network(now)`` -> ``{node: LinkFigures}``
(:mod:`fabricd.engines.monitor.table`); :mod:`~fabricd.engines.monitor.estimator` turns
TCP_INFO samples into a node's own figures."""
