"""Providers: the ways of running a child agent that the service can register."""
