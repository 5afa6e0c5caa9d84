"""Per-GPU tables of tuned kernel launch configurations (the skinny GEMM's and
the fused MoE's): one JSON file per GPU model, named after it."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

logger = logging.getLogger(__name__)


def table_file_name(device_name: str) -> str:
    """A GPU's table file: its name with runs of other characters as _."""
    return re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_") + ".json"


def read_table(path: Path, kind: str, fallback: str) -> dict:
    """The table at ``path``: {} where there is none, or where it cannot be read
    (logged, saying ``fallback``: what the engine does instead)."""
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        logger.warning("%s table %s is unreadable (%s); %s", kind, path, e, fallback)
        return {}
