"""What running fabricd under an orchestrator needs beyond the daemon itself: in
:mod:`~fabricd.deploy.kubernetes`, a DaemonSet's membership computed from a headless Service.
"""
