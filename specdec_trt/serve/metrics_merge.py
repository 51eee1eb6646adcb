"""One Prometheus exposition of several replicas' metrics: every sample gains a ``replica`` label, and the
samples of each metric are gathered under one HELP and TYPE, as Prometheus requires."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

REPLICA_LABEL = "replica"


class _Families:
    """A collector of already-parsed metric families."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def merge_expositions(by_replica: Mapping[str, bytes]) -> bytes:
    """The expositions of ``by_replica`` (replica name -> its /metrics text) as one."""
    merged: dict[str, Metric] = {}
    for replica, text in sorted(by_replica.items()):
        for family in text_string_to_metric_families(text.decode()):
            into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type, family.unit))
            into.samples += [
                sample._replace(labels={**sample.labels, REPLICA_LABEL: replica}) for sample in family.samples
            ]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(merged.values())))
    return generate_latest(registry)
