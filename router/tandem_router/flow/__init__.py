"""Tenant flow control, pure: the limits file (``limits``), the fair-sharing admission core (``fair``), the cluster
capacity learned from the workers' gauges (``capacity``) and what a request asks for (``requests``). The async
adapter in the request path is ``tandem_router.flow_control``."""
