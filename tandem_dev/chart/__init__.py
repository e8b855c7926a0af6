"""The Helm chart's configuration: one pydantic model from which values.yaml and values.schema.json are generated."""
