"""kopf's login (``kopf.on.login`` in ``run/main.py``) from the shared ``tandem.kube.credentials``, so kopf's own
API calls and the operator's (``tandem.kube.rest``) authenticate alike."""

from __future__ import annotations

import kopf

from tandem.kube.credentials import Credentials


def connection_info(credentials: Credentials) -> kopf.ConnectionInfo:
    """Called again after a 401: a ServiceAccount token file is read afresh."""
    return kopf.ConnectionInfo(
        server=credentials.server,
        ca_path=credentials.ca_path,
        ca_data=credentials.ca_data,
        insecure=credentials.insecure,
        scheme="Bearer" if credentials.token or credentials.token_path else None,
        token=credentials.bearer_token(),
        certificate_path=credentials.certificate_path,
        certificate_data=credentials.certificate_data,
        private_key_path=credentials.private_key_path,
        private_key_data=credentials.private_key_data,
        default_namespace=credentials.namespace,
    )
