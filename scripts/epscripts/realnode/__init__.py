"""Real nodes on a scripts/controlplane run: kubelet + containerd + runc + CNI (docs/fleet.md)."""
