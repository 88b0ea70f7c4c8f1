"""A fleet of hollow Kubernetes nodes, each behind its own node-local balancer.

``scripts/fleet`` (docs/fleet.md) on top of a ``scripts/controlplane`` run: kubemark hollow
kubelets, one network namespace per node, each with extractedprism, HAProxy, nginx or the
Go original on the node's 127.0.0.1:7445, plus kube-controller-manager and
kube-scheduler. Standard library only (it runs with the system python3, like
scripts/controlplane); the modules:

* ``balancers``: each balancer's configuration and command line;
* ``nodes``: :class:`nodes.Fleet`: namespaces, certificates, processes, up/down;
* ``observe``: Node readiness, Lease renewals and connections, seen from outside;
* ``cost``: what the fleet costs the control plane (the API servers' own request
  counters, /proc of the API servers, etcd, the balancers and the kubelets).
"""
