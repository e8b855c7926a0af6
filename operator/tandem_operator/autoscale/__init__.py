"""SLO-driven autoscaling: pure signals and decider, the loop that scrapes and scales (``loop``)."""
