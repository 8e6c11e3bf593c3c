"""Federated learning on the digits data: coordinator, clients, and a one-command run."""
