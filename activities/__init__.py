"""Temporal activities: idempotent steps over the clients, one class per client group."""
