"""Output integrity's I/O beside its pure core (``tandem_router.integrity``): the probes that send requests of their
own (``canary``, ``shadow`` comparisons, ``probation`` mirrors, all through ``pair_request``), the hooks on client
traffic (``hooks``), and what is shared with the other routers through the registry (``publisher``: this router's
report; ``members``: the routers present, to split the probing)."""
