"""Pure decisions: what the operator should do, from what it observed (no Kubernetes, HTTP or etcd client, no
adapter: import-linter checks it)."""
