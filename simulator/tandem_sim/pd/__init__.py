"""PD and transfer: the prefill and decode sides of one rank, the bootstrap and hand-over servers, the Mooncake
transfer engine and Store, its ports, multi-node groups, and the start-up that pulls weights from a seed."""
