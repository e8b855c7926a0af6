"""Tandem: prefill/decode disaggregated LLM serving (SGLang + Mooncake) on Kubernetes.

Packages:
- ``tandem``: shared pieces (CLI, etcd registry schema, process supervision, logging).
- ``tandem_sim``: the simulated SGLang worker (``tandem sim``).
- ``tandem_router``: the OpenAI-compatible PD router (``tandem router``).
- ``tandem_operator``: the kopf operator (``tandem operator``).
"""

__version__ = "0.2.0"
