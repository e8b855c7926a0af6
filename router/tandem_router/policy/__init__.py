"""Routing decisions as pure functions: no HTTP library, no I/O, no clock reads (time is passed in).

``selection`` picks workers, ``breaker`` decides whether a worker or pair may take traffic, ``retry`` decides
whether and when to try again, ``bootstrap`` builds the PD fields, ``load`` reads workers' ``/metrics`` text.
"""
