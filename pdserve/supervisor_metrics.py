"""The supervisor's /metrics: restarts per component, and what was given up on.

`pdserve up` serves these on its own port (the one after its processes'), from
a registry of its own, read at scrape time from the supervisor's watches.
"""

from __future__ import annotations

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from common.metrics.families import labelled_counter
from pdserve.supervisor import Health, Supervisor


class SupervisorCollector(Collector):
    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor

    def collect(self):
        watches = list(self.supervisor.watches.values())
        yield labelled_counter(
            "pdserve_supervisor_restarts_total",
            "Times pdserve up started a component again after it exited",
            {},
            "component",
            {w.name: w.restarts for w in watches},
        )
        for name, doc, state in (
            (
                "pdserve_supervisor_given_up",
                "1 when pdserve up gave up restarting the component (it crashed too often)",
                Health.GIVEN_UP,
            ),
            (
                "pdserve_supervisor_serving",
                "1 when the component answered its health check since it last started",
                Health.SERVING,
            ),
        ):
            family = GaugeMetricFamily(name, doc, labels=["component"])
            for w in watches:
                family.add_metric([w.name], 1.0 if w.state is state else 0.0)
            yield family
