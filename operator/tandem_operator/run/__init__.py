"""Running the operator: the kopf handlers, the runtime that owns each cluster's state, the reconcile pass, the
entry point and `tandem render`."""
