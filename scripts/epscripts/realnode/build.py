"""Build (once) and cache what a real node needs beyond Debian's packages: the kubelet
(from the Go module proxy, the same pinned Kubernetes as the control plane) and the
sandbox ("pause") binary, compiled statically from Kubernetes' own
``build/pause/linux/pause.c`` in the module cache (no registry is reachable here, so
``registry.k8s.io/pause`` cannot be pulled; node.py imports it into containerd).

Cached beside the control plane's binaries (``controlplane/<version>/``), under the
same lock, built to a temporary name and renamed into place.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from epscripts.controlplane import build as cpbuild

BINARIES = ("kubelet", "pause")


def binary(name: str) -> Path:
    return cpbuild.binary(name)


def missing() -> list[str]:
    return [b for b in BINARIES if not os.access(binary(b), os.X_OK)]


def _log(msg: str) -> None:
    cpbuild._log(f"realnode: {msg}")


def _pause_source(go: str, work: Path) -> Path:
    out = cpbuild._run(go, ["mod", "download", "-json",
                            f"k8s.io/kubernetes@{cpbuild.KUBERNETES_VERSION}"], work)
    src = Path(json.loads(out)["Dir"]) / "build" / "pause" / "linux" / "pause.c"
    if not src.exists():
        raise SystemExit(f"realnode build: {src} not found in the module cache")
    return src


def _build_pause(src: Path) -> None:
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise SystemExit("realnode build: no C compiler for the pause binary (gcc)")
    dest = binary("pause")
    tmp = dest.with_name(f".pause.tmp.{os.getpid()}")
    try:
        subprocess.run([cc, "-Os", "-Wall", "-Werror", "-static",
                        "-DVERSION=v3.10-extractedprism", "-o", str(tmp), str(src)],
                       check=True, capture_output=True, text=True)
        subprocess.run(["strip", str(tmp)], check=False, capture_output=True)
        os.chmod(tmp, 0o755)
        os.replace(tmp, dest)
    except subprocess.CalledProcessError as exc:
        raise SystemExit(f"realnode build: compiling pause.c failed:\n{exc.stderr}") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def build() -> Path:
    """Build the control plane's binaries and whatever of ours is missing."""
    cpbuild.build()
    if not missing():
        return cpbuild.cache_dir()
    go = cpbuild.find_go()
    if go is None:
        raise SystemExit("realnode build: no Go toolchain (set GO= or put go on PATH)")
    with cpbuild._lock():
        todo = missing()
        if not todo:
            return cpbuild.cache_dir()
        t0 = time.monotonic()
        _log(f"building {', '.join(todo)} into {cpbuild.cache_dir()}")
        with tempfile.TemporaryDirectory(prefix="ep-rn-build-") as tmp:
            w = Path(tmp)
            if "pause" in todo:
                _build_pause(_pause_source(go, w))
            if "kubelet" in todo:
                staging = cpbuild._staging_modules(go, w)
                cpbuild._wrapper(w, "extractedprism.local/k8sbuild",
                                 {"k8s.io/kubernetes": cpbuild.KUBERNETES_VERSION},
                                 {m: cpbuild.STAGING_VERSION for m in staging},
                                 ["k8s.io/kubernetes/cmd/kubelet"])
                cpbuild._run(go, ["mod", "tidy"], w)
                cpbuild._build_one(go, w, "k8s.io/kubernetes/cmd/kubelet", "kubelet",
                                   cpbuild.K8S_LDFLAGS)
        _log(f"done in {time.monotonic() - t0:.0f}s")
    return cpbuild.cache_dir()


if __name__ == "__main__":
    print(build())
