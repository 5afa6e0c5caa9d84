"""A worker extension for tests/engine/test_tensor_parallel.py: what a follower
rank was told, and which layers each step reported, written as JSON lines."""

from __future__ import annotations

import json


class Probe:
    def __init__(self, runner) -> None:
        self.runner = runner

    def _write(self, path: str, record: dict) -> None:
        record["rank"] = self.runner.tp.rank
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def record(self, payload: dict) -> None:
        heads = list(self.runner.layout.kv_heads)
        self._write(payload["path"], {"tag": payload["tag"], "kv_heads": heads})

    def watch_layers(self, payload: dict) -> None:
        probe = self

        class Observer:
            def begin_step(self, batch):
                if batch is not None:
                    raise AssertionError("a follower's observer is asked without a batch")
                layers: list[int] = []

                def done(layer: int) -> None:
                    layers.append(layer)
                    if layer == probe.runner.config.model_config.num_hidden_layers - 1:
                        probe._write(payload["path"], {"tag": "step", "layers": layers})

                return done

        self.runner.kv_observer = Observer()

    def unwatch(self, payload: dict) -> None:
        self.runner.kv_observer = None
