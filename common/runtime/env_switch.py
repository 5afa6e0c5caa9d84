"""An on/off switch read from a PDSERVE_* variable, the same way for every process."""

from __future__ import annotations

import os
import sys


def env_switch(var: str) -> bool | None:
    """The variable as 1 or 0; None when unset or empty (the default applies)."""
    value = os.environ.get(var, "")
    if value not in ("", "0", "1"):
        # Exit 2, as argparse does for a bad flag: pdserve up reads it as a
        # configuration error and does not restart the component.
        print(f"error: {var} must be 1 or 0, got {value!r}", file=sys.stderr)
        raise SystemExit(2)
    return None if value == "" else value == "1"
