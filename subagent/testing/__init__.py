"""Test support shipped to users: stub ACP agents and a pytest plugin."""
