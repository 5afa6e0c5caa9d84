"""The wire contract: *.proto files, their generated stubs (`make proto`), and a light client."""
