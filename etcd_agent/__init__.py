"""etcd-agent: keeps the etcd members of bare-metal Kubernetes masters alive."""
__version__ = "0.1.0"
