"""The production profile: the flag values extractedprism ships with wherever it is
deployed, each with the reason for it. Pure data.

The flag table's defaults stay the spec's (the contract): a bare ``extractedprism
--endpoints ...`` behaves as the spec says. What an operator installs, though, runs these
values: the chart's ``values.yaml``, ``extractedprism static-pod`` (unless
``--profile=none``), the kubeadm, systemd and Talos examples. This is the one place they
are written. ``extractedprism profile`` prints them (EP_ variables or flags),
``tests/deploy/test_profile.py`` fails when any deployment path drifts from them, and
``scripts/sync-profile`` rewrites the files that carry them after a change here.

readyz needs a CA file (and where anonymous /readyz is off, the node's credentials): the
paths differ per deployment, so each path supplies them (the chart: the pod's
service-account CA; the static pod and the examples: the node's files).
"""

from __future__ import annotations

from dataclasses import dataclass

from extractedprism.config.table import FLAG_BY_NAME


@dataclass(frozen=True)
class Setting:
    """One flag of the profile: its value as an operator would type it, and why."""

    flag: str
    value: str
    reason: str

    @property
    def env(self) -> str:
        return FLAG_BY_NAME[self.flag].env

    @property
    def arg(self) -> str:
        return f"--{self.flag}={self.value}"


NAME = "production"

# In the order docs/deploy.md explains them: detection, then what moves the connections.
PRODUCTION: tuple[Setting, ...] = (
    Setting("health-check", "readyz",
            "a frozen or etcd-less API server still accepts TCP; only its /readyz says so"),
    Setting("health-interval", "5s",
            "a sick API server is found within seconds; each API server answers N / interval "
            "probes a second for N nodes"),
    Setting("health-timeout", "1s",
            "a probe (and a client dial) within a region answers in milliseconds; a hung "
            "one fails fast"),
    Setting("answer-hedge-delay", "500ms",
            "half the timeout: a ClientHello unanswered that long goes to a second API "
            "server too, and the two race"),
    Setting("health-recheck", "1s",
            "the check confirming a first failure runs 1 s after it, not a whole interval"),
    Setting("unready-drain-timeout", "1s",
            "an unready API server's watches move 1 s after its exclusion (not the 30 s kept for "
            "removed ones)"),
    Setting("overload-guard", "true",
            "servers all answering late in a stampede stay in service: overload closes "
            "no connection"),
    Setting("stall-timeout", "2s",
            "a request unanswered for 2 s (the node's own traffic) runs its API server's "
            "next check now"),
    Setting("upstream-selection", "least-conn",
            "new connections avoid a server piling up hung ones and fill the emptiest after "
            "a roll"),
    Setting("rebalance-interval", "15s",
            "long-lived connections spread again after a roll or scale-out: one quiet close "
            "per node per interval"),
    Setting("slow-start", "20s",
            "a recovered or new API server warms its watch cache before it takes a full "
            "share"),
)

PROFILES: dict[str, tuple[Setting, ...]] = {NAME: PRODUCTION, "none": ()}


def flags(profile: tuple[Setting, ...] = PRODUCTION) -> dict[str, str]:
    """flag name -> value, in the profile's order."""
    return {s.flag: s.value for s in profile}


def env(profile: tuple[Setting, ...] = PRODUCTION) -> dict[str, str]:
    """EP_ variable -> value, in the profile's order."""
    return {s.env: s.value for s in profile}


def args(profile: tuple[Setting, ...] = PRODUCTION) -> list[str]:
    """``--flag=value`` for each setting, in the profile's order."""
    return [s.arg for s in profile]
