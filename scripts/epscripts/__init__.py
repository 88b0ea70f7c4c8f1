"""The project's scripts as packages: one per tool, each run by one entry script in scripts/.

  common        ports, deadline polling, starting/stopping children (every tool uses it)
  bench/        scripts/bench: direct vs HAProxy vs extractedprism on loopback (+ ab, handover)
  chaos/        scripts/chaos-local: the local chaos run, and the one on a real control plane
  controlplane/ scripts/controlplane: etcd + three kube-apiservers in network namespaces
  demo/         scripts/demo: three local TLS upstreams and extractedprism in front

The entry scripts put scripts/ and the repository on PYTHONPATH and run ``python -m
epscripts.<tool>``; tests import the same modules with scripts/ on sys.path.
"""
