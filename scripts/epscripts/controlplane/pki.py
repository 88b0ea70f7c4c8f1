"""The run's PKI (openssl) and kubeconfigs."""

from __future__ import annotations

import json
import secrets
import subprocess
from pathlib import Path
from typing import Any

from epscripts.controlplane.host import NODE_NAME, SERVER_NAME, CPError

# --- PKI (openssl) ------------------------------------------------------------


def _openssl(*args: str, cwd: Path) -> None:
    proc = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=60)
    if proc.returncode != 0:
        raise CPError(f"openssl {args[0]} failed: {proc.stderr.strip()[-500:]}")


def issue(pki: Path, name: str, subject: str, ext: str) -> None:
    _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject,
             cwd=pki)
    (pki / f"{name}.ext").write_text(
        ext + "\nbasicConstraints=critical,CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
        "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-CAcreateserial", "-days", "7", "-sha256", "-extfile", f"{name}.ext",
             "-out", f"{name}.crt", cwd=pki)
    (pki / f"{name}.csr").unlink()
    (pki / f"{name}.ext").unlink()


def make_pki(pki: Path, ips: list[str]) -> dict[str, str]:
    """One CA for serving and client certificates; returns the tokens."""
    pki.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "7", "-sha256",
             "-subj", "/CN=extractedprism-controlplane-ca",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=pki)
    sans = ",".join(["DNS:kubernetes", "DNS:kubernetes.default", f"DNS:{SERVER_NAME}",
                     "DNS:kubernetes.default.svc.cluster.local", "DNS:localhost",
                     "IP:127.0.0.1", *(f"IP:{ip}" for ip in ips)])
    issue(pki, "apiserver", "/CN=kube-apiserver",
           f"subjectAltName={sans}\nextendedKeyUsage=serverAuth")
    # The node's kubelet client certificate, as the Node authorizer expects it.
    issue(pki, "node", f"/O=system:nodes/CN=system:node:{NODE_NAME}",
           "extendedKeyUsage=clientAuth")
    issue(pki, "admin", "/O=system:masters/CN=cp-admin", "extendedKeyUsage=clientAuth")
    # Service-account token signing pair.
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", "sa.key", cwd=pki)
    _openssl("ec", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)
    tokens = {"admin": secrets.token_hex(16), "extractedprism": secrets.token_hex(16)}
    (pki / "tokens.csv").write_text(
        f'{tokens["admin"]},cp-admin,cp-admin,"system:masters"\n'
        f'{tokens["extractedprism"]},extractedprism,extractedprism,""\n')
    (pki / "admin.token").write_text(tokens["admin"] + "\n")
    (pki / "extractedprism.token").write_text(tokens["extractedprism"] + "\n")
    for f in pki.iterdir():
        f.chmod(0o600)
    return tokens


def kubeconfig(server: str, ca: str, token: str | None = None, cert: str | None = None,
               key: str | None = None, server_name: str | None = SERVER_NAME) -> str:
    """A kubeconfig as JSON (a YAML subset, so every loader reads it)."""
    cluster: dict[str, Any] = {"server": server, "certificate-authority": ca}
    if server_name:
        cluster["tls-server-name"] = server_name
    user: dict[str, Any] = {}
    if token:
        user["token"] = token
    if cert:
        user["client-certificate"] = cert
        user["client-key"] = key or cert
    return json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "cp",
        "clusters": [{"name": "cp", "cluster": cluster}],
        "users": [{"name": "cp", "user": user}],
        "contexts": [{"name": "cp", "context": {"cluster": "cp", "user": "cp"}}],
    }, indent=1) + "\n"
