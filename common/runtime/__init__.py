"""A pdserve process at run time: node start-up and shutdown, flags, heartbeat, ports, GC, event loop."""
