"""Typed clients (import name ``areal_clients``)."""
