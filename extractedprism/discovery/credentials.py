"""Where discovery connects and as whom: the service account, or a kubeconfig read
without the ``kubernetes`` package; every file re-read when it changes.

Owns turning configuration into a :class:`Target` (address, TLS context, the name the
server certificate is verified as, the ``Authorization`` header) and the reasons a
configuration cannot be used. Each target is made by a
:class:`~extractedprism.files.Reloaded`, so a rotated CA bundle, client certificate,
key, token file or kubeconfig is used from the next request on: the watcher calls
:meth:`~extractedprism.files.Reloaded.get` before each request (a ``stat`` per file).

The kubeconfig is read as client-go reads it (``k8s.io/client-go/tools/clientcmd``),
for what a node-local proxy needs: ``current-context`` -> the context's ``cluster``
and ``user``; the cluster's ``server`` (https, an optional path prefix),
``certificate-authority`` / ``-data`` (the data wins, as in client-go; neither: the
system's trust store), ``insecure-skip-tls-verify`` (refused together with a CA, as
client-go refuses it) and ``tls-server-name``; the user's ``client-certificate`` /
``-data`` and ``client-key`` / ``-data`` (the data wins), ``token`` and ``tokenFile``
(the file wins when both are given: client-go re-reads it and prefers its last good
value), ``username`` / ``password`` (basic). Relative paths are taken from the
kubeconfig's own directory, as client-go does. Embedded certificate data is handed to
OpenSSL through an anonymous memory file (``memfd_create``), so nothing is written to
disk (the ``kubernetes`` package wrote it to temporary files).

Not read here: ``exec`` and ``auth-provider`` plugins (``uses_plugin``: the caller then
hands the file to the ``kubernetes`` package, which runs them; only those users pay its
~25 MiB), ``proxy-url`` and impersonation (``as``, ``as-groups``...), which are refused
with a clear error rather than ignored.

Runs on the watcher thread (and once on the main thread, :func:`check_kubeconfig`, at
start-up).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import ipaddress
import os
import ssl
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

from extractedprism.errors import Error, one_line
from extractedprism.files import FileProblem, Reads, Reloaded, bearer_token

T = TypeVar("T")

TLS_SERVER_NAME = "kubernetes.default.svc"
# A bearer token is a few KiB; a kubeconfig with embedded certificates a few tens.
MAX_TOKEN_BYTES = 64 * 1024
MAX_KUBECONFIG_BYTES = 4 * 1024 * 1024
PLUGINS = ("exec", "auth-provider")
# Fields that change how the client reaches or who it claims to be, which this reader
# does not do: refused, never silently ignored.
UNSUPPORTED_USER = ("as", "as-uid", "as-groups", "as-user-extra")
UNSUPPORTED_CLUSTER = ("proxy-url",)


class ClientConfigError(Error):
    """Discovery was configured (kubeconfig or service account) but cannot be used."""


class KubeconfigError(ClientConfigError):
    """``--kubeconfig`` names a file that is missing or not a usable kubeconfig: a
    mistake on the command line, so start-up stops (exit 2)."""

    exit_status = 2


@dataclass(frozen=True)
class Target:
    """One way to the API server, as made from the files at one moment."""

    url: str  # scheme://host:port[/prefix], for logs
    host: str
    port: int
    prefix: str  # the server URL's path, "" or "/something" (before /apis/...)
    tls: ssl.SSLContext
    server_name: str | None  # SNI and the name the certificate is verified as
    authorization: str  # the Authorization header's value, "" for none


# --- the service account ---------------------------------------------------------------


def service_account(url: str, ca_path: str, token_path: str) -> Reloaded[Target]:
    """In a cluster: ``url`` (this proxy's own listener), the service account's CA and
    token, the certificate verified as ``kubernetes.default.svc``."""
    parts = _server(url, "the proxy's own listener")

    def make(reads: Reads) -> Target:
        tls = _context()
        _load_ca_pem(tls, reads.read(ca_path, "service account CA file"), ca_path)
        token = _token(reads.read(token_path, "service account token file",
                                  MAX_TOKEN_BYTES), token_path)
        return Target(url, *parts, tls, TLS_SERVER_NAME, f"Bearer {token}")

    return Reloaded(make)


# --- the kubeconfig -------------------------------------------------------------------


def check_kubeconfig(path: str) -> str:
    """Start-up: raise :class:`KubeconfigError` (one line naming the file and what is
    wrong) unless ``path`` is a kubeconfig discovery can use. A file it refers to is
    not held against it: it may appear or be fixed later (a kubelet's certificate on a
    joining node), and until then each request fails naming it; its problem is
    returned (for a warning), else "". A kubeconfig that needs a plugin is checked
    only as far as its current context."""
    doc = _document(path)
    if uses_plugin(doc, path):
        return ""
    try:
        _target(doc, path, Reads())
    except KubeconfigError:
        raise
    except (FileProblem, ClientConfigError) as exc:
        return str(exc)
    return ""


def uses_plugin(doc: dict[str, Any], path: str) -> bool:
    """True when the current context's user runs an exec or auth-provider plugin."""
    _, user = _current(doc, path)
    return any(bool(user.get(p)) for p in PLUGINS)


def read_kubeconfig(path: str) -> dict[str, Any]:
    """The kubeconfig as a document; raises :class:`KubeconfigError`."""
    return _document(path)


def kubeconfig(path: str) -> Reloaded[Target]:
    """The kubeconfig's current context, made again when the kubeconfig or any file it
    names changes."""

    def make(reads: Reads) -> Target:
        doc = _document(path, reads)
        return _target(doc, path, reads)

    return Reloaded(make)


def plugin_kubeconfig(path: str, build: Callable[[], T]) -> Reloaded[T]:
    """For a kubeconfig the ``kubernetes`` package reads (a user with an exec or
    auth-provider plugin): ``build()`` made again when the kubeconfig or a file its
    current context names (CA, client certificate and key, token file) changes, as
    :func:`kubeconfig` is for the rest. The package reads the files once per client it
    makes, so a rotated CA is used only by a client made after the rotation."""
    keys = (("cluster", "certificate-authority"), ("user", "client-certificate"),
            ("user", "client-key"), ("user", "tokenFile"))

    def make(reads: Reads) -> T:
        cluster, user = _current(_document(path, reads), path)
        base = os.path.dirname(os.path.abspath(path))
        for section, key in keys:
            value = (cluster if section == "cluster" else user).get(key)
            if isinstance(value, str) and value:
                reads.path(value if os.path.isabs(value) else os.path.join(base, value), key)
        return build()

    return Reloaded(make)


def _document(path: str, reads: Reads | None = None) -> dict[str, Any]:
    import yaml  # ~1.5 MiB, and only with --kubeconfig

    try:
        raw = (reads or Reads()).read(path, "kubeconfig", MAX_KUBECONFIG_BYTES)
    except FileProblem as exc:
        raise KubeconfigError(f"--kubeconfig: {exc}") from None
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        doc = yaml.load(raw, Loader=loader)  # a safe loader: no object construction
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise KubeconfigError(f"kubeconfig {path}: not valid YAML{where}: {problem}") from None
    except UnicodeDecodeError:
        raise KubeconfigError(f"kubeconfig {path}: not UTF-8 text") from None
    if not isinstance(doc, dict):
        raise KubeconfigError(f"kubeconfig {path}: not a kubeconfig (a YAML mapping with "
                              "clusters, users, contexts and current-context)")
    return doc


def _named(doc: dict[str, Any], path: str, section: str, key: str, name: str
           ) -> dict[str, Any]:
    entries = doc.get(section) or []
    if not isinstance(entries, list):
        raise KubeconfigError(f"kubeconfig {path}: {section} is not a list")
    for entry in entries:
        if isinstance(entry, dict) and entry.get("name") == name:
            value = entry.get(key) or {}
            if not isinstance(value, dict):
                raise KubeconfigError(f"kubeconfig {path}: {section} {name!r}: {key} is "
                                      "not a mapping")
            return value
    raise KubeconfigError(f"kubeconfig {path}: no {section[:-1]} named {name!r} "
                          f"(in {section})")


def _current(doc: dict[str, Any], path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(cluster, user) of the current context."""
    name = doc.get("current-context")
    if not isinstance(name, str) or not name:
        raise KubeconfigError(f"kubeconfig {path}: no current-context")
    context = _named(doc, path, "contexts", "context", name)
    cluster_name = context.get("cluster")
    if not isinstance(cluster_name, str) or not cluster_name:
        raise KubeconfigError(f"kubeconfig {path}: context {name!r} names no cluster")
    cluster = _named(doc, path, "clusters", "cluster", cluster_name)
    user_name = context.get("user")
    user: dict[str, Any] = {}
    if user_name:  # no user: anonymous, as client-go allows
        user = _named(doc, path, "users", "user", str(user_name))
    return cluster, user


def _server(url: str, where: str) -> tuple[str, int, str]:
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ClientConfigError(f"{where}: server {url!r} is not a URL: {exc}") from None
    if parts.scheme != "https":
        raise ClientConfigError(f"{where}: server {url!r} must be an https:// URL")
    if not parts.hostname:
        raise ClientConfigError(f"{where}: server {url!r} names no host")
    return parts.hostname, port or 443, parts.path.rstrip("/")


def _target(doc: dict[str, Any], path: str, reads: Reads) -> Target:
    cluster, user = _current(doc, path)
    where = f"kubeconfig {path}"
    for key in UNSUPPORTED_CLUSTER:
        if cluster.get(key):
            raise KubeconfigError(f"{where}: cluster {key} is not supported")
    for key in UNSUPPORTED_USER:
        if user.get(key):
            raise KubeconfigError(f"{where}: user {key} (impersonation) is not supported")
    server = cluster.get("server")
    if not isinstance(server, str) or not server:
        raise KubeconfigError(f"{where}: the current context's cluster has no server")
    try:
        host, port, prefix = _server(server, where)
    except ClientConfigError as exc:
        raise KubeconfigError(str(exc)) from None
    base = os.path.dirname(os.path.abspath(path))

    def file(key: str) -> str:
        value = user.get(key) if key in ("client-certificate", "client-key", "tokenFile") \
            else cluster.get(key)
        if not value:
            return ""
        if not isinstance(value, str):
            raise KubeconfigError(f"{where}: {key} is not a path")
        if "\0" in value:  # no file is ever named so: the kubeconfig is wrong, not late
            raise KubeconfigError(f"{where}: {key} ({one_line(value)}) contains a NUL byte")
        return value if os.path.isabs(value) else os.path.join(base, value)

    def data(section: dict[str, Any], key: str) -> bytes | None:
        value = section.get(key)
        if not value:
            return None
        try:
            # Line breaks and spaces are skipped, as Go's base64 decoder skips them.
            return base64.b64decode("".join(str(value).split()), validate=True)
        except (binascii.Error, ValueError):
            raise KubeconfigError(f"{where}: {key} is not base64") from None

    insecure = cluster.get("insecure-skip-tls-verify", False)
    if not isinstance(insecure, bool):
        raise KubeconfigError(f"{where}: insecure-skip-tls-verify must be true or false")
    ca_data, ca_file = data(cluster, "certificate-authority-data"), file("certificate-authority")
    if insecure and (ca_data or ca_file):
        raise KubeconfigError(f"{where}: insecure-skip-tls-verify with a "
                              "certificate-authority is not allowed (as in kubectl)")
    server_name = cluster.get("tls-server-name") or None
    if server_name is not None and not isinstance(server_name, str):
        raise KubeconfigError(f"{where}: tls-server-name is not a string")
    tls = _context()
    if insecure:
        tls.check_hostname = False
        tls.verify_mode = ssl.CERT_NONE
    elif ca_data is not None:
        _load_ca_pem(tls, ca_data, f"{where}: certificate-authority-data", KubeconfigError)
    elif ca_file:
        _load_ca_pem(tls, reads.read(ca_file, "certificate-authority"), ca_file)
    else:
        tls.load_default_certs()

    cert_data, key_data = data(user, "client-certificate-data"), data(user, "client-key-data")
    cert_file, key_file = file("client-certificate"), file("client-key")
    has_cert, has_key = bool(cert_data or cert_file), bool(key_data or key_file)
    if has_cert != has_key:
        raise KubeconfigError(f"{where}: client-certificate without client-key" if has_cert
                              else f"{where}: client-key without client-certificate")
    if has_cert:
        with _pem_path(cert_data, cert_file, "client-certificate", reads) as cert, \
                _pem_path(key_data, key_file, "client-key", reads) as key:
            _load_cert_chain(tls, cert, key, where, KubeconfigError
                             if cert_data is not None and key_data is not None
                             else ClientConfigError)

    authorization = ""
    token_file = file("tokenFile")
    token = user.get("token")
    if token_file:
        authorization = "Bearer " + _token(reads.read(token_file, "tokenFile",
                                                      MAX_TOKEN_BYTES), token_file)
    elif token:
        authorization = "Bearer " + _token(str(token).encode(), f"{where}: token",
                                           KubeconfigError)
    elif user.get("username") or user.get("password"):
        pair = f"{user.get('username') or ''}:{user.get('password') or ''}"
        authorization = "Basic " + base64.b64encode(pair.encode()).decode()
    url = f"https://{_bracket(host)}:{port}{prefix}"
    return Target(url, host, port, prefix, tls, server_name, authorization)


# --- TLS and tokens -------------------------------------------------------------------


def _context() -> ssl.SSLContext:
    # As urllib3 makes it: TLS 1.2 or newer, certificate and name verified.
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    tls.minimum_version = ssl.TLSVersion.TLSv1_2
    return tls


def _load_ca_pem(tls: ssl.SSLContext, pem: bytes, what: str,
                 error: type[ClientConfigError] = ClientConfigError) -> None:
    try:
        tls.load_verify_locations(cadata=pem.decode("ascii"))
    except UnicodeDecodeError:
        raise error(f"CA unusable: {what}: not PEM text") from None
    except ssl.SSLError as exc:
        # cadata says "no start line: cadata does not contain a certificate" (no reason)
        empty = exc.reason in ("NO_CERTIFICATE_OR_CRL_FOUND", "NO_START_LINE") \
            or "does not contain a certificate" in str(exc)
        why = "no PEM certificate found" if empty else _ssl_reason(exc)
        raise error(f"CA unusable: {what}: {why}") from None


class _Encrypted(Error):
    pass


def _no_password() -> bytes:
    raise _Encrypted  # OpenSSL asks only for an encrypted key: never prompt


def _load_cert_chain(tls: ssl.SSLContext, cert: str, key: str, where: str,
                     error: type[ClientConfigError]) -> None:
    try:
        tls.load_cert_chain(cert, key, password=_no_password)
    except _Encrypted:
        raise error(f"{where}: client-key is encrypted; a passphrase is not "
                    "supported") from None
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise error(f"{where}: client-key does not match client-certificate") from None
        raise error(f"{where}: client-certificate or client-key unusable: "
                    f"{_ssl_reason(exc)}") from None
    except OSError as exc:
        raise error(f"{where}: client-certificate or client-key unreadable: "
                    f"{exc.strerror or exc}") from None


@contextlib.contextmanager
def _pem_path(data: bytes | None, path: str, what: str, reads: Reads) -> Iterator[str]:
    """A path OpenSSL can open: the file as named, or the embedded data in an anonymous
    memory file (or, without memfd, a private temporary file), gone after the load."""
    if data is None:
        yield reads.path(path, what)
        return
    if hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd"):
        fd = os.memfd_create(what, os.MFD_CLOEXEC)
        named = f"/proc/self/fd/{fd}"
    else:
        fd, named = tempfile.mkstemp(prefix="extractedprism-")
    try:
        os.write(fd, data)
        yield named
    finally:
        os.close(fd)
        if not named.startswith("/proc/"):
            with contextlib.suppress(OSError):
                os.unlink(named)


def _token(raw: bytes, where: str, error: type[ClientConfigError] = ClientConfigError
           ) -> str:
    try:
        return bearer_token(raw)
    except ValueError as exc:
        raise error(f"token unusable: {where}: {exc}") from None


def _ssl_reason(exc: ssl.SSLError) -> str:
    reason = getattr(exc, "reason", None)
    return str(reason).lower().replace("_", " ") if reason else str(exc)


def _bracket(host: str) -> str:
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]"
    return host

