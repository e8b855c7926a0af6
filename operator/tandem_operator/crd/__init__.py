"""CustomResourceDefinitions generated from the api models (``python -m tandem_operator.crdgen``)."""
