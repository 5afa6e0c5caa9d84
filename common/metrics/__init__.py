"""Prometheus metrics of every pdserve process (docs/metrics.md lists them).

- ``histogram``: a batch-observing cumulative histogram and our buckets
  (no prometheus-client import: the stats objects that own histograms use it);
- ``families``: metric-family builders for collectors;
- ``phases``: a computed prompt's queue and prefill time, per node;
- ``node`` / ``router``: the collectors, reading at scrape time what each
  process already keeps (engine snapshot, worker and router stats);
- ``server``: ``--metrics-port``, one registry and HTTP endpoint per process,
  and the port plan `pdserve up` uses for processes sharing a host.
"""
