"""extractedprism: a per-node TCP load balancer for Kubernetes API servers."""

__version__ = "0.1.0"
