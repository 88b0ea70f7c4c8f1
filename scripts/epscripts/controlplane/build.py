"""Build (once) and cache the real control-plane binaries: etcd, kube-apiserver, kubectl.

Pinned versions live here and nowhere else. The binaries go to
``${XDG_CACHE_HOME:-~/.cache}/extractedprism/controlplane/<version>/`` (outside the work
tree, so every clone and worktree on the machine shares one build) and are rebuilt only
when missing. Each binary is built to a temporary name in that directory and renamed
into place, so a killed build never leaves a half binary that a later run would trust;
an flock serialises concurrent builders (two test sessions starting together).

Kubernetes is built through a small wrapper module: it requires k8s.io/kubernetes and
replaces each staging module that kubernetes' go.mod lists at exactly v0.0.0 (those are
resolved through relative ``replace`` lines upstream, which a dependent module cannot
use) with the published module of the same minor version. etcd's server module has the
same relative replaces, so it is built from a wrapper module too.

Standard library only: scripts/controlplane runs it with the system python3.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

KUBERNETES_VERSION = "v1.34.4"
STAGING_VERSION = "v0.34.4"  # the staging modules published with KUBERNETES_VERSION
ETCD_VERSION = "v3.6.6"
GO_DEFAULT = "/usr/local/go/bin/go"

K8S_LDFLAGS = " ".join([
    f"-X k8s.io/component-base/version.gitVersion={KUBERNETES_VERSION}",
    "-X k8s.io/component-base/version.gitMajor=1",
    f"-X k8s.io/component-base/version.gitMinor={KUBERNETES_VERSION.split('.')[1]}",
    "-X k8s.io/component-base/version.gitTreeState=clean",
    "-s", "-w",  # no symbol table / DWARF: smaller binaries, faster link
])
ETCD_LDFLAGS = "-s -w"


def version_tag() -> str:
    """One directory name for the whole pinned set."""
    return f"k8s-{KUBERNETES_VERSION}_etcd-{ETCD_VERSION}"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "extractedprism" / "controlplane" / version_tag()


BINARIES = ("etcd", "kube-apiserver", "kubectl")
# Built only when the fleet of hollow nodes is asked for (scripts/fleet build), so the
# plain control plane stays as fast to build as it was.
FLEET_BINARIES = ("kube-controller-manager", "kube-scheduler", "kubemark")


def binary(name: str) -> Path:
    return cache_dir() / name


def missing(fleet: bool = False) -> list[str]:
    names = BINARIES + (FLEET_BINARIES if fleet else ())
    return [b for b in names if not os.access(binary(b), os.X_OK)]


def find_go() -> str | None:
    env = os.environ.get("GO")
    if env and os.access(env, os.X_OK):
        return env
    found = shutil.which("go")
    if found:
        return found
    return GO_DEFAULT if os.access(GO_DEFAULT, os.X_OK) else None


def _log(msg: str) -> None:
    print(f"controlplane build: {msg}", file=sys.stderr, flush=True)


def _go_env() -> dict[str, str]:
    env = dict(os.environ)
    # Module mode regardless of what the caller's GOFLAGS says; the module cache stays at
    # its default (~/go/pkg/mod) so later builds and other clones reuse the 750 MB download.
    env["GOFLAGS"] = "-mod=mod -buildvcs=false"
    # An older local Go fetches the toolchain go.mod asks for (a module, from the proxy).
    env.setdefault("GOTOOLCHAIN", "auto")
    env["CGO_ENABLED"] = "0"  # static binaries; needs no C toolchain
    return env


def _run(go: str, args: list[str], cwd: Path) -> str:
    t0 = time.monotonic()
    proc = subprocess.run([go, *args], cwd=cwd, env=_go_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"controlplane build: `go {' '.join(args)}` failed "
                         f"(exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    _log(f"go {args[0]} {' '.join(a for a in args[1:] if not a.startswith('-X'))[:120]} "
         f"took {time.monotonic() - t0:.0f}s")
    return proc.stdout


def _staging_modules(go: str, work: Path) -> list[str]:
    """Modules kubernetes' go.mod requires at exactly v0.0.0 (its staging tree)."""
    out = _run(go, ["mod", "download", "-json", f"k8s.io/kubernetes@{KUBERNETES_VERSION}"], work)
    gomod = Path(json.loads(out)["GoMod"]).read_text()
    mods = sorted(set(re.findall(r"^\s*(k8s\.io/[\w./-]+)\s+v0\.0\.0\s*$", gomod, re.M)))
    if not mods:
        raise SystemExit("controlplane build: found no v0.0.0 staging modules in "
                         f"k8s.io/kubernetes@{KUBERNETES_VERSION}'s go.mod")
    return mods


def _wrapper(work: Path, module: str, requires: dict[str, str], replaces: dict[str, str],
             imports: list[str]) -> None:
    lines = [f"module {module}", "", "go 1.24", "", "require ("]
    lines += [f"\t{m} {v}" for m, v in requires.items()]
    lines += [")", ""]
    if replaces:
        lines += ["replace ("]
        lines += [f"\t{m} => {m} {v}" for m, v in replaces.items()]
        lines += [")", ""]
    (work / "go.mod").write_text("\n".join(lines))
    # The tools-file pattern: tidy keeps the main packages' dependencies; never compiled.
    body = "\n".join(f'\t_ "{p}"' for p in imports)
    (work / "tools.go").write_text(f"//go:build tools\n\npackage tools\n\nimport (\n{body}\n)\n")


def _build_one(go: str, work: Path, pkg: str, name: str, ldflags: str) -> None:
    dest = binary(name)
    tmp = dest.with_name(f".{name}.tmp.{os.getpid()}")
    try:
        _run(go, ["build", "-trimpath", "-ldflags", ldflags, "-o", str(tmp), pkg], work)
        os.chmod(tmp, 0o755)
        os.replace(tmp, dest)  # atomic: a reader sees no binary or the whole one
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


@contextlib.contextmanager
def _lock() -> Iterator[None]:
    cache_dir().mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def build(fleet: bool = False) -> Path:
    """Build whatever is missing (with ``fleet``, the hollow-node binaries too); returns
    the cache directory."""
    if not missing(fleet):
        return cache_dir()
    go = find_go()
    if go is None:
        raise SystemExit("controlplane build: no Go toolchain (set GO= or put go on PATH)")
    with _lock():
        todo = missing(fleet)  # another builder may have finished while we waited
        if not todo:
            return cache_dir()
        t0 = time.monotonic()
        _log(f"building {', '.join(todo)} into {cache_dir()} with {go}")
        with tempfile.TemporaryDirectory(prefix="ep-cp-build-") as tmp:
            root = Path(tmp)
            if "etcd" in todo:
                w = root / "etcd"
                w.mkdir()
                _wrapper(w, "extractedprism.local/etcdbuild",
                         {"go.etcd.io/etcd/server/v3": ETCD_VERSION}, {},
                         ["go.etcd.io/etcd/server/v3"])
                _run(go, ["mod", "tidy"], w)
                _build_one(go, w, "go.etcd.io/etcd/server/v3", "etcd", ETCD_LDFLAGS)
            k8s = [b for b in todo if b != "etcd"]
            if k8s:
                w = root / "k8s"
                w.mkdir()
                staging = _staging_modules(go, w)
                _log(f"{len(staging)} staging modules replaced at {STAGING_VERSION}")
                _wrapper(w, "extractedprism.local/k8sbuild",
                         {"k8s.io/kubernetes": KUBERNETES_VERSION},
                         {m: STAGING_VERSION for m in staging},
                         [f"k8s.io/kubernetes/cmd/{n}"
                          for n in ("kube-apiserver", "kubectl",
                                    *(k for k in k8s if k in FLEET_BINARIES))])
                _run(go, ["mod", "tidy"], w)
                for name in k8s:
                    _build_one(go, w, f"k8s.io/kubernetes/cmd/{name}", name, K8S_LDFLAGS)
        _log(f"done in {time.monotonic() - t0:.0f}s")
    return cache_dir()
