"""The router: public API, routing policy, admin service, admin CLI."""
