"""Custom-resource models (pydantic): the single source of truth for the CRDs the operator serves."""
