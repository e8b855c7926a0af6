"""Container images built here without a Docker engine: debootstrap + chroot + a deterministic OCI writer."""
