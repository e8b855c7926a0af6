"""Development tooling: the dev cluster, benchmarks, chaos runs, the local stack, test fixtures and
generators. Not part of the runtime image (the ``tandem`` wheel leaves this package out)."""
