"""The Kubernetes client of the operator and the router: ``credentials`` (kubeconfig or ServiceAccount), ``rest``
(one aiohttp session: requests and streamed answers) and ``watch`` (list, then watch, a label selector)."""
