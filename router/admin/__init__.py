"""The router's admin side: the Admin gRPC service and the operator CLI (`pdctl`)."""
