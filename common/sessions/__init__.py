"""Sessions: many requests over one long-lived bidi gRPC call (client and server ends)."""
