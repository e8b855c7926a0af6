"""``tandem chaos``: bounded chaos runs under load (``cli``), on the local stack or the dev cluster
(``devcluster``), with the faults (``faults``), the load and its references (``load``), one run's plan and
measurement (``run``), the verdicts and tables (``report``) and the plots (``plots``)."""
